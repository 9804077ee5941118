"""MD throughput of halopipe: NVE steps/s and atom-steps/s on 1 and 2 local ranks.

Systems: Lennard-Jones argon (fcc, 32,000 atoms, cutoff 8.5 Å) and the demo
composite (ChargeModel -> DSFCoulomb wired + Lennard-Jones; NaCl, 8,000 atoms).
Each case builds the system, takes ``--warmup`` velocity-Verlet steps (the first
neighbour lists and halos), then times ``--steps`` steps; the time of the
slowest rank counts. Neighbour lists use a 1 Å skin, so the timed steps include
the rebuilds and migrations a real run has.

    python benchmarks/md_throughput.py                 # default: short run, a few minutes on 2 cores
    python benchmarks/md_throughput.py --steps 50 --nproc 1 2 4 --markdown
    python benchmarks/md_throughput.py --cases lj-argon-32k --steps 10000 --reporters both --markdown

``--reporters``: ``none`` (default), ``default`` (a run's default output: a
thermo log every 100 steps, with pressure, and a trajectory frame every
1,000, written on rank 0) or ``both`` (each case without, then with them, so
the cost of output shows as the ratio of the two rates).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halopipe import keep_freed_memory  # noqa: E402
from halopipe.distributed.launch import spawn  # noqa: E402

CASES = {
    "lj-argon-32k": "32,000 Ar atoms, Lennard-Jones (8.5 Å)",
    "demo-composite-8k": "8,000 NaCl atoms, ChargeModel->DSFCoulomb (10 Å) + LJ (8 Å)",
    "demo-composite-216": "216 NaCl atoms, the same composite (the `halopipe demo` default size)",
    "nacl-pme-4k": "4,096 rattled NaCl ions, LJ (8 Å) + PME(8 Å, 1e-4), the peers.py nacl-4k case",
}


def build(case: str, device: str):
    """(pipeline, system) of a benchmark case."""
    from halopipe import PME, Group, LennardJones, Pipeline, Step
    from halopipe.config.sections import ArgonSpec
    from halopipe.demo import demo_pipeline, demo_system

    if case == "lj-argon-32k":
        system = ArgonSpec(type="argon", cells=20, lattice=5.26, rattle=0.02, seed=0).build(torch.float64)
        pipeline = Pipeline([LennardJones(epsilon=0.0104, sigma=3.4, cutoff=8.5)])
    elif case.startswith("demo-composite"):
        system = demo_system(cells=10 if case.endswith("8k") else 3)
        pipeline = demo_pipeline()
    elif case == "nacl-pme-4k":
        system = _rattled_nacl()
        lj = LennardJones({11: 0.0115, 17: 0.0043}, {11: 2.0, 17: 3.4}, cutoff=8.0)
        pipeline = Pipeline([Group([Step(lj), Step(PME(8.0, 1e-4))], autograd=False)])  # fixed charges: direct forces
    else:
        raise ValueError(f"unknown case {case!r}; choose from {list(CASES)}")
    return pipeline.to(device=device), system.to(device=device)


def time_step(case: str) -> float:
    """The case's velocity-Verlet step in fs: 2 fs for argon, 1 fs for the ionic cases."""
    return 2.0 if case.startswith("lj") else 1.0


def _rattled_nacl():
    """Rock-salt NaCl, 8 x 8 x 8 cubic cells (4,096 ions), rattled by 0.25 Å, charges +-1 (as peers.py's nacl-4k)."""
    import numpy as np
    from ase.build import bulk

    from halopipe import System

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((8, 8, 8))
    atoms.positions += np.random.default_rng(0).normal(scale=0.25, size=atoms.positions.shape)
    system = System.from_ase(atoms)
    system.fields["charges"] = torch.where(system.numbers == 11, 1.0, -1.0).to(system.positions.dtype)
    return system


THERMO_EVERY, TRAJECTORY_EVERY = 100, 1000  # a run's default output (``--reporters default``)


def default_reporters(folder: str) -> list:
    """A thermo log every 100 steps and a trajectory frame every 1,000, as a production run writes them."""
    from halopipe.dynamics import ThermoLog, Trajectory

    thermo = ThermoLog(os.path.join(folder, "thermo.csv"), every=THERMO_EVERY)
    return [thermo, Trajectory(os.path.join(folder, "traj.xyz"), every=TRAJECTORY_EVERY)]


def worker(case: str, steps: int, warmup: int, device: str, reporters: bool = False) -> dict:
    """One rank: run NVE and time it (every rank calls this); ``reporters``: with :func:`default_reporters`."""
    import tempfile

    from halopipe.dynamics import Simulation, VelocityVerlet

    rank = dist.get_rank() if dist.is_initialized() else 0
    pipeline, system = build(case, device)
    integrator = VelocityVerlet(time_step(case))
    # each rank its own folder (only rank 0 writes), removed with what the reporters wrote
    with tempfile.TemporaryDirectory(prefix="halopipe-md-") as folder:
        output = default_reporters(folder) if reporters else []
        sim = Simulation(pipeline, system if rank == 0 else None, integrator, reporters=output)  # the default skin, 1 Å
        sim.set_velocities(300.0, seed=1)
        sim.run(warmup)
        rebuilds0 = sim.sharded.rebuilds
        gc.collect()  # no full collection owed from the set-up falls in the timed window
        if dist.is_initialized():
            dist.barrier()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sim.run(steps)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = float(sim.sharded.all_reduce(torch.tensor([time.perf_counter() - t0], dtype=torch.float64), "max")[0])
    return {
        "n_atoms": sim.sharded.n_total,
        "seconds": elapsed,
        "steps": steps,
        "rebuilds": sim.sharded.rebuilds - rebuilds0,
        "world": sim.sharded.world_size,
    }


def measure(case: str, nproc: int, steps: int, warmup: int, device: str, reporters: bool = False) -> dict:
    if nproc == 1:
        keep_freed_memory()  # as `halopipe run` and the launcher's ranks do
        torch.set_num_threads(1)
        return worker(case, steps, warmup, device, reporters)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    return spawn(worker, nproc, case, steps, warmup, device, reporters, timeout=36000, backend=backend, threads=1)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts (default 1 2)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--reporters", choices=["none", "default", "both"], default="none", help="output during the timed steps (see above)"
    )
    args = parser.parse_args(argv)
    outputs = {"none": [False], "default": [True], "both": [False, True]}[args.reporters]
    rows = []
    for case in args.cases:
        for nproc in args.nproc:
            for reporters in outputs:
                r = measure(case, nproc, args.steps, args.warmup, args.device, reporters)
                rate = r["steps"] / r["seconds"]
                label = f"{case} + output" if reporters else case
                rows.append((label, r["n_atoms"], nproc, rate, rate * r["n_atoms"], r["rebuilds"]))
                print(f"# {label} on {nproc} rank(s): {rate:.3f} steps/s", file=sys.stderr, flush=True)
    threads = os.environ.get("OMP_NUM_THREADS", "default")
    header = ("case", "atoms", "ranks", "steps/s", "atom-steps/s", "rebuilds")
    print(
        f"\nNVE throughput, float64, {args.device}, 1 thread per rank (OMP_NUM_THREADS={threads}), {args.steps} timed steps after "
        f"{args.warmup} warm-up, skin 1 Å"
    )
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for case, n, p, rate, atom_rate, rb in rows:
            print(f"| {case} | {n} | {p} | {rate:.3f} | {atom_rate:.3g} | {rb} |")
    else:
        print(f"{header[0]:<30}{header[1]:>8}{header[2]:>7}{header[3]:>12}{header[4]:>15}{header[5]:>10}")
        for case, n, p, rate, atom_rate, rb in rows:
            print(f"{case:<30}{n:>8}{p:>7}{rate:>12.3f}{atom_rate:>15.3g}{rb:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
