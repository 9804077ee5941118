"""Weak scaling of the per-rank communication volume: fixed atoms per rank, growing rank count.

Each rank owns a 2x2x2 block of cubic NaCl cells (64 atoms, an 11.3 Å brick);
the box grows with the brick grid. Two workloads run on the same ranks:

* ``lj_pme``: LJ (5 Å, direct) + PME (6 Å real space, ``mesh="distributed"``,
  order 4, 8 mesh points per cell and axis, so 4096 mesh points per rank);
* ``mace``: a small random-weight MACE (2 interactions, r_max 5 Å, 16x0e+16x1o
  node features = 64 numbers per row, correlation 2) with per-layer refresh
  of the ghost rows' features, forces by autograd (refresh backward included).

After a warm-up evaluation (first plan, neighbour lists) the traffic is read
over ``--steps`` evaluations with forces (MD steps without a rebuild: skin 1
Å, positions unchanged), then over one evaluation after every atom moved
0.6 Å (> skin/2: a rebuild with migration). Per rank and step, largest over
ranks: bytes and messages, split into the halo (the plan's point-to-point
traffic: refreshes, their backwards, migration and plan metadata) and the
mesh (everything PME's distributed FFT sends: transposes and the exchange of
the charge/potential boxes, told apart by the calling module); collective
calls and the payload of all-reduces/broadcasts (from the ``Comm`` counters);
ghost rows; peak RSS of the process (cumulative: ``mace`` runs after
``lj_pme``); and the extra halo messages and bytes of the rebuild step.
Time on a 2-core machine is meaningless and is not reported.

The tables end with a least-squares fit of each quantity to ``c P^s`` over
P > 1 (the exponent ``s`` tells flat, 0, from linear, 1).

    python benchmarks/weak_scaling.py --nproc 1 2 4 8 12 16 27
    python benchmarks/weak_scaling.py --layout chain --nproc 3 6 12 24

On the cubic grids a rank's halo partners fill in as axes get split: ghost
rows across an unsplit axis are periodic images of the rank's own atoms (no
message); the neighbourhood is complete (26 neighbouring bricks, all other
ranks) once every axis has 3 or more bricks, at 27 ranks. The chain layout
reaches that state at 3 ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table, rank  # noqa: E402

from halopipe import Group, LennardJones, Pipeline, Step, System  # noqa: E402
from halopipe.distributed import DomainConfig, ShardedSystem  # noqa: E402
from halopipe.distributed.comm import Comm  # noqa: E402
from halopipe.distributed.launch import spawn  # noqa: E402
from halopipe.models.pme import PME  # noqa: E402

GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2), 12: (3, 2, 2), 16: (4, 2, 2), 27: (3, 3, 3)}
# ``--layout chain``: P bricks along x. From 3 bricks on, every rank has its full neighbourhood (two other ranks
# along x, periodic images of itself along y and z), so the halo's traffic must be exactly flat from there on.
CELLS_PER_BRICK = 2  # cubic NaCl cells per brick and axis: 64 atoms per rank
MESH_PER_CELL = 8  # PME mesh points per cell and axis: 4096 per rank
REBUILD_MOVE = 0.6  # Å along x for every atom: more than skin/2, so the next evaluation rebuilds and migrates
WORKLOADS = ("lj_pme", "mace")
COLUMNS = [
    "halo_bytes",
    "halo_msgs",
    "mesh_bytes",
    "mesh_msgs",
    "collectives",
    "reduce_bytes",
    "ghost_rows",
    "peak_rss_mib",
    "rebuild_msgs",
    "rebuild_bytes",
]


def salt(grid) -> System:
    from ase.build import bulk

    repeat = tuple(CELLS_PER_BRICK * g for g in grid)
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(repeat)
    atoms.positions += np.random.default_rng(0).normal(scale=0.05, size=atoms.positions.shape)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def small_mace():
    """A small random-weight mace-torch model for Na and Cl (float64), built the way tests/models/test_mace.py does."""
    import mace  # noqa: F401  (first: lets e3nn load its constants under recent torch)
    from e3nn import o3
    from mace import modules

    from halopipe.models.mace import MACE

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(7)
        module = modules.MACE(
            r_max=5.0,
            num_bessel=6,
            num_polynomial_cutoff=5,
            max_ell=1,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            num_interactions=2,
            num_elements=2,
            hidden_irreps=o3.Irreps("16x0e+16x1o"),
            MLP_irreps=o3.Irreps("8x0e"),
            atomic_energies=np.array([-1.0, -2.0]),
            avg_num_neighbors=20.0,
            atomic_numbers=[11, 17],
            correlation=2,
            gate=torch.nn.functional.silu,
            radial_MLP=[16, 16],
        )
    finally:
        torch.set_default_dtype(old)
    return MACE(module.double())


def pipeline_for(workload: str, grid, config: DomainConfig) -> Pipeline:
    if workload == "lj_pme":
        mesh = tuple(MESH_PER_CELL * CELLS_PER_BRICK * g for g in grid)
        lj = LennardJones(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.0, 17: 3.4}, cutoff=5.0)
        pme = PME(cutoff=6.0, mesh_size=mesh, mesh="distributed")
        return Pipeline([Group([Step(lj)], autograd=False), Group([Step(pme)])], config=config)
    return Pipeline([Group([Step(small_mace())], autograd=True)], config=config)


class Traffic:
    """Point-to-point and all-to-all bytes and messages this rank sends, split by who sent them (halo or mesh).

    Wraps ``Comm.exchange`` and ``Comm.all_to_all_into`` at class level (so
    sub-communicators are seen too); a call made from the distributed FFT's
    module (``distributed/fft.py``: transposes and box exchanges) counts as mesh.
    """

    MESH_MODULE = os.path.join("distributed", "fft.py")

    def __init__(self) -> None:
        self.totals = {"halo": [0, 0], "mesh": [0, 0]}  # channel -> [bytes, messages]
        exchange, all_to_all_into = Comm.exchange, Comm.all_to_all_into
        traffic = self

        def counted_exchange(comm, sends, recv_shapes, dtype, device, **options):
            # a message is a tensor or a halo row gather (comm.Gathered): its shape and the exchange's dtype give its bytes
            out = [(math.prod(t.shape) * dtype.itemsize, 1) for r, t in sends.items() if t.shape[0] and r != comm.rank]
            traffic._add(out)
            return exchange(comm, sends, recv_shapes, dtype, device, **options)

        def counted_all_to_all_into(comm, sends, outs):
            traffic._add([(t.numel() * t.element_size(), 1) for r, t in enumerate(sends) if t.numel() and r != comm.rank])
            return all_to_all_into(comm, sends, outs)

        Comm.exchange, Comm.all_to_all_into = counted_exchange, counted_all_to_all_into

    def _add(self, pieces: list[tuple[int, int]]) -> None:
        channel = "halo"
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.endswith(self.MESH_MODULE):
                channel = "mesh"
                break
            frame = frame.f_back
        self.totals[channel][0] += sum(b for b, _ in pieces)
        self.totals[channel][1] += len(pieces)

    def snapshot(self, comm: Comm) -> list[int]:
        h, m = self.totals["halo"], self.totals["mesh"]
        return [h[0], h[1], m[0], m[1], comm.collectives, comm.reduce_bytes]


def measure_workload(workload: str, grid, steps: int, traffic: Traffic) -> list[float]:
    system = salt(grid) if rank() == 0 else None
    config = DomainConfig(grid=grid, skin=1.0, timeout=600)
    sharded = ShardedSystem.scatter(system, config)
    pipeline = pipeline_for(workload, grid, config)
    out = pipeline(sharded)  # warm-up: plan and lists
    comm = sharded.comm
    before = traffic.snapshot(comm)
    for _ in range(steps):
        out = pipeline(sharded)
    after = traffic.snapshot(comm)
    per_step = [(a - b) / steps for a, b in zip(after, before)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    ghosts = float(out["halo"]["exchanged"])
    rebuilds = sharded.rebuilds
    sharded.positions = sharded.positions + torch.tensor([REBUILD_MOVE, 0.0, 0.0], dtype=sharded.positions.dtype)
    pipeline(sharded)
    assert sharded.rebuilds == rebuilds + 1, "the moved atoms should have rebuilt the plan"
    rebuild = [a - b for a, b in zip(traffic.snapshot(comm), after)]
    extra_msgs, extra_bytes = rebuild[1] - per_step[1], rebuild[0] - per_step[0]  # halo traffic beyond a plain step
    return max_over_ranks([*per_step, ghosts, peak, extra_msgs, extra_bytes])


def measure(grid, steps: int, workloads: tuple[str, ...]) -> dict[str, list[float]]:
    traffic = Traffic()
    return {w: measure_workload(w, grid, steps, traffic) for w in workloads}


def fits(ps: list[int], values: list[float], smallest: int = 2) -> str:
    """``value ~ c P^s``: the exponent s from a least-squares fit in log-log (P >= smallest only)."""
    pts = [(p, v) for p, v in zip(ps, values) if p >= max(smallest, 2) and v > 0]
    if len(pts) < 2:
        return "-"
    x, y = np.log([p for p, _ in pts]), np.log([v for _, v in pts])
    slope, intercept = np.polyfit(x, y, 1)
    return f"{math.exp(intercept):.3g} P^{slope:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=sorted(GRIDS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layout", choices=("cubic", "chain"), default="cubic", help="brick grids: near-cubic (GRIDS) or P x 1 x 1")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    args = parser.parse_args()
    grids = {p: (p, 1, 1) if args.layout == "chain" else GRIDS[p] for p in args.nproc}
    table: dict[str, dict[int, list[float]]] = {w: {} for w in args.workloads}
    for p in args.nproc:
        got = spawn(measure, p, grids[p], args.steps, tuple(args.workloads), timeout=3600)[0]
        for w in args.workloads:
            table[w][p] = got[w]
            print([w, p, grids[p]] + [f"{v:.0f}" for v in got[w]], flush=True)
    for w in args.workloads:
        ps = sorted(table[w])
        rows = [[p, grids[p]] + [f"{v:.0f}" for v in table[w][p]] for p in ps]
        print_table(f"Weak scaling, {w}, per rank per step, largest over ranks", ["P", "grid"] + COLUMNS, rows)
        # From 8 ranks on every axis of the cubic grids is split: all ghost rows come from other ranks.
        fit_rows = [[k] + [fits(ps, [table[w][p][i] for p in ps], lo) for lo in (2, 8)] for i, k in enumerate(COLUMNS)]
        print_table(f"Fits, {w} (value ~ c P^s)", ["quantity", "P >= 2", "P >= 8"], fit_rows)


if __name__ == "__main__":
    main()
