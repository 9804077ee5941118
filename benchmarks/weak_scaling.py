"""Weak scaling of the per-rank communication volume: fixed atoms per rank, growing rank count.

Each rank owns a 2x2x2 block of cubic NaCl cells (64 atoms, an 11.3 Å brick);
the box grows with the brick grid, and so does the PME mesh (8 points per
cell and axis, so mesh points per rank stay 4096). The workload is LJ (5 Å) +
PME (6 Å real space, ``mesh="distributed"``, order 4). After a warm-up
evaluation (plan, neighbour lists) the counters of :class:`~halopipe.distributed.Comm`
are read over ``--steps`` evaluations with forces (MD steps without a
rebuild: skin 1 Å, positions unchanged). Per rank and step, largest over
ranks: bytes and messages sent point to point and all-to-all, collective
calls, payload of all-reduces/broadcasts, the all-to-all (PME transpose)
part of the bytes, ghost rows, and peak RSS of the
process. Time on a 2-core machine is meaningless and is not reported.

The table ends with a least-squares fit of each quantity to ``a + b log2 P``
and ``c P^s`` (the exponent ``s`` tells flat, 0, from linear, 1).

    python benchmarks/weak_scaling.py --nproc 1 2 4 8 12 16 27
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table, rank  # noqa: E402

from halopipe import Group, LennardJones, Pipeline, Step, System  # noqa: E402
from halopipe.distributed import DomainConfig, ShardedSystem  # noqa: E402
from halopipe.distributed.launch import spawn  # noqa: E402
from halopipe.models.pme import PME  # noqa: E402

GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 12: (3, 2, 2), 16: (4, 2, 2), 27: (3, 3, 3)}
CELLS_PER_BRICK = 2  # cubic NaCl cells per brick and axis: 64 atoms per rank
MESH_PER_CELL = 8  # PME mesh points per cell and axis: 4096 per rank
COLUMNS = ["bytes", "all_to_all_bytes", "messages", "collectives", "reduce_bytes", "ghost_rows", "peak_rss_mib"]


def salt(grid) -> System:
    from ase.build import bulk

    repeat = tuple(CELLS_PER_BRICK * g for g in grid)
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(repeat)
    atoms.positions += np.random.default_rng(0).normal(scale=0.05, size=atoms.positions.shape)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def measure(grid, steps: int) -> list[float]:
    system = salt(grid) if rank() == 0 else None
    config = DomainConfig(grid=grid, skin=1.0, timeout=600)
    sharded = ShardedSystem.scatter(system, config)
    mesh = tuple(MESH_PER_CELL * CELLS_PER_BRICK * g for g in grid)
    lj = LennardJones(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.0, 17: 3.4}, cutoff=5.0)
    pme = PME(cutoff=6.0, mesh_size=mesh, mesh="distributed")
    pipeline = Pipeline([Group([Step(lj)], autograd=False), Group([Step(pme)])], config=config)
    out = pipeline(sharded)  # warm-up: plan and lists
    comm = sharded.comm
    before = (comm.bytes_sent, comm.all_to_all_bytes, comm.messages_sent, comm.collectives, comm.reduce_bytes)
    for _ in range(steps):
        out = pipeline(sharded)
    after = (comm.bytes_sent, comm.all_to_all_bytes, comm.messages_sent, comm.collectives, comm.reduce_bytes)
    per_step = [(a - b) / steps for a, b in zip(after, before)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return max_over_ranks([*per_step, float(out["halo"]["exchanged"]), peak])


def fits(ps: list[int], values: list[float]) -> str:
    """``value ~ c P^s``: the exponent s from a least-squares fit in log-log (P > 1 only)."""
    pts = [(p, v) for p, v in zip(ps, values) if p > 1 and v > 0]
    if len(pts) < 2:
        return "-"
    x, y = np.log([p for p, _ in pts]), np.log([v for _, v in pts])
    slope, intercept = np.polyfit(x, y, 1)
    return f"{math.exp(intercept):.3g} P^{slope:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=sorted(GRIDS))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows, table = [], {}
    for p in args.nproc:
        table[p] = spawn(measure, p, GRIDS[p], args.steps, timeout=1800)[0]
        rows.append([p, GRIDS[p]] + [f"{v:.0f}" for v in table[p]])
        print(rows[-1], flush=True)
    print_table("Weak scaling, LJ + PME (distributed mesh), per rank per step, largest over ranks", ["P", "grid"] + COLUMNS, rows)
    ps = sorted(table)
    fit_rows = [[k, fits(ps, [table[p][i] for p in ps])] for i, k in enumerate(COLUMNS)]
    print_table("Fits over P > 1 (value ~ c P^s)", ["quantity", "fit"], fit_rows)


if __name__ == "__main__":
    main()
