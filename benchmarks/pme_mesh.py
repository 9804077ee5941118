"""Replicated vs distributed PME mesh: time, peak memory and bytes per rank, and the ``mesh="auto"`` crossover.

For each number of ranks and cubic mesh size, one fresh set of processes
evaluates a PME-only pipeline (energy, forces, stress) on a NaCl box with
``PME(mesh="replicated")`` or ``PME(mesh="distributed")`` and reports, per
rank (largest over ranks):

* time: best of ``--repeats`` evaluations (meaningful only relative to each
  other on a shared machine);
* peak RSS growth: the process's peak resident memory after the evaluations
  minus before the first one (``ru_maxrss``; fresh processes per row);
* bytes sent: point-to-point and all-to-all bytes counted by ``Comm``, plus
  for the replicated mesh the ring all-reduce of ``M`` float64 values
  (``2 (P - 1) / P * 8 M`` bytes, forward only: the backward reuses the
  potential), which ``Comm`` does not count.

    python benchmarks/pme_mesh.py --nproc 2 4 --mesh 16 32 64 128

``--transposes`` measures the distributed FFT alone, slab vs pencil grid:
per rank (largest over ranks) and per forward + inverse transform, the
all-to-all bytes and messages sent and the collectives (counted by
``Comm``), the largest block a rank holds at any stage (``grid_cost``) and
the peak RSS growth of a fresh process from after a warm-up on a tiny mesh
(process groups made, FFT library loaded) to the end.

    python benchmarks/pme_mesh.py --transposes --nproc 4 8 16 --mesh 64 192
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table, rank, timed  # noqa: E402

from halopipe import Group, Pipeline, Step, System  # noqa: E402
from halopipe.distributed import Comm, DomainConfig, ShardedSystem  # noqa: E402
from halopipe.distributed.fft import PencilMeshTransform, choose_grid, grid_cost  # noqa: E402
from halopipe.distributed.launch import spawn  # noqa: E402
from halopipe.models.pme import PME  # noqa: E402


def salt(repeat: int) -> System:
    import numpy as np
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((repeat,) * 3)
    atoms.positions += np.random.default_rng(0).normal(scale=0.1, size=atoms.positions.shape)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def run(mode: str, mesh: int, repeats: int) -> list[float]:
    system = salt(4)
    config = DomainConfig(timeout=300)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    pipeline = Pipeline([Group([Step(PME(cutoff=6.0, accuracy=1e-5, mesh_size=(mesh,) * 3, mesh=mode))])], config=config)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    pipeline(sharded, stress=True)  # warm-up: plans, neighbour lists
    sent0 = sharded.comm.bytes_sent
    seconds, _ = timed(lambda: pipeline(sharded, stress=True), repeats)
    sent = (sharded.comm.bytes_sent - sent0) / repeats
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_rss) / 1024.0
    p = sharded.world_size
    if mode == "replicated" and p > 1:
        sent += 2 * (p - 1) / p * 8 * mesh**3
    return max_over_ranks([seconds, peak, sent])


def transposes(mesh: int, decomposition: str, repeats: int) -> list[float]:
    """Traffic and memory of ``repeats`` forward + inverse transforms of a ``mesh^3`` mesh (largest over ranks)."""
    import torch

    comm = Comm(timeout=300)
    grid = choose_grid((mesh,) * 3, comm.size, decomposition)
    # Warm-up on a tiny mesh of the same grid: the row and column groups and the FFT library's first use.
    tiny = PencilMeshTransform(comm, (2 * grid[0], 2 * grid[1], 4), grid)
    tiny.inverse(tiny.forward(torch.zeros(tiny.real_shape(), dtype=torch.float64)))
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    transform = PencilMeshTransform(comm, (mesh,) * 3, grid)
    block = torch.randn(transform.real_shape(), dtype=torch.float64)
    transform.inverse(transform.forward(block))
    counters = ("all_to_all_bytes", "messages_sent", "collectives")
    start = [getattr(comm, name) for name in counters]
    for _ in range(repeats):
        transform.inverse(transform.forward(block))
    counted = [(getattr(comm, name) - s) / repeats for name, s in zip(counters, start)]
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_rss) / 1024.0
    return max_over_ranks([*counted, peak])


def transpose_table(nprocs: list[int], meshes: list[int], repeats: int) -> None:
    rows = []
    for p in nprocs:
        for mesh in meshes:
            for decomposition in ("slab", "pencil"):
                grid = choose_grid((mesh,) * 3, p, decomposition)
                sent, messages, collectives, peak = spawn(transposes, p, mesh, decomposition, repeats, timeout=900)[0]
                held = grid_cost((mesh,) * 3, grid)["held"]
                auto = "yes" if choose_grid((mesh,) * 3, p) == grid else ""
                rows.append([p, f"{mesh}^3", f"{grid[0]}x{grid[1]}", auto, f"{sent / 1e6:.3f}", f"{messages:.0f}", f"{collectives:.0f}"])
                rows[-1] += [f"{held / 2**20:.2f}", f"{peak:.1f}"]
                print(rows[-1], flush=True)
    header = ["ranks", "mesh", "grid", "auto pick", "MB sent", "messages", "collectives", "largest block (MiB)", "peak RSS (MiB)"]
    print_table("Distributed FFT, per rank per forward + inverse (largest over ranks)", header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mesh", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transposes", action="store_true", help="the FFT's transposes alone: slab vs pencil traffic and memory")
    args = parser.parse_args()
    if args.transposes:
        transpose_table(args.nproc, args.mesh, args.repeats)
        return
    rows = []
    for p in args.nproc:
        for mesh in args.mesh:
            res = {mode: spawn(run, p, mode, mesh, args.repeats, timeout=900)[0] for mode in ("replicated", "distributed")}
            r, d = res["replicated"], res["distributed"]
            times = [f"{x[0] * 1e3:.1f}" for x in (r, d)]
            memory = [f"{x[1]:.1f}" for x in (r, d)]
            sent = [f"{x[2] / 1e6:.2f}" for x in (r, d)]
            rows.append([p, f"{mesh}^3", *times, *memory, *sent])
            print(rows[-1], flush=True)
    header = ["ranks", "mesh", "t repl (ms)", "t dist (ms)", "peak RSS repl (MiB)", "peak RSS dist (MiB)", "MB sent repl", "MB sent dist"]
    print_table("PME mesh: replicated vs distributed (largest over ranks)", header, rows)


if __name__ == "__main__":
    main()
