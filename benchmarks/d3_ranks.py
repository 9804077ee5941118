"""DFT-D3 on 1 and more ranks: the parallel speed-up of the lattice sums.

Each case is one of :mod:`d3_structures`' structures with DFT-D3(BJ, PBE)
alone (no ATM) at the given two-body cutoff (CN cutoff 40 bohr), in a direct
group. On P ranks (gloo, 1 thread each) the system is scattered once into a
:class:`~halopipe.distributed.ShardedSystem` (as a simulation keeps it) and
the evaluation is timed on it: the best of ``--repeats`` evaluations after one
untimed one (kernel loading), energy + forces, and + stress with ``--stress``.
The energy is checked against the one-rank run.

    python benchmarks/d3_ranks.py --cases si-4k --nproc 1 2
    python benchmarks/d3_ranks.py --cases si-512 rutile-576 --cutoff 31.75 --nproc 1 2 --stress
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import print_table, timed  # noqa: E402
from d3_structures import build  # noqa: E402

from halopipe.distributed.launch import spawn  # noqa: E402

CN_CUTOFF = 40.0 * 0.52917721067  # 40 bohr, Å


def worker(case: str, cutoff: float, repeats: int, stress: bool) -> dict:
    """One rank: scatter the case, evaluate once untimed, then time ``repeats`` evaluations."""
    import torch.distributed as dist

    from halopipe import DFTD3, Group, Pipeline, Step, System
    from halopipe.distributed import ShardedSystem

    rank = dist.get_rank() if dist.is_initialized() else 0
    system = System.from_ase(build(case)) if rank == 0 else None
    pipeline = Pipeline([Group([Step(DFTD3("pbe", cutoff=cutoff, cn_cutoff=CN_CUTOFF))], autograd=False)])
    sharded = ShardedSystem.scatter(system, pipeline.config)
    pipeline(sharded, stress=stress)
    seconds, out = timed(lambda: pipeline(sharded, stress=stress), repeats)
    return {"seconds": seconds, "energy": float(out["energy"]), "n_atoms": sharded.n_total, "world": sharded.world_size}


def measure(case: str, nproc: int, cutoff: float, repeats: int, stress: bool) -> dict:
    if nproc == 1:
        torch.set_num_threads(1)
        return worker(case, cutoff, repeats, stress)
    return spawn(worker, nproc, case, cutoff, repeats, stress, timeout=3600, threads=1)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["si-4k"], help="d3_structures names (si-512, si-4k, urea-432, rutile-576, ...)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cutoff", type=float, default=50.2021581370876, help="two-body cutoff, Å (default sqrt(9000) bohr)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stress", action="store_true", help="also compute the stress")
    args = parser.parse_args(argv)
    rows = []
    for case in args.cases:
        base = None
        for nproc in args.nproc:
            r = measure(case, nproc, args.cutoff, args.repeats, args.stress)
            base = base or r
            speedup = base["seconds"] / r["seconds"]
            de = abs(r["energy"] - base["energy"]) / abs(base["energy"])
            rows.append([case, r["n_atoms"], nproc, f"{r['seconds'] * 1e3:.0f}", f"{speedup:.2f}x", f"{de:.1e}"])
    what = "E+F+stress" if args.stress else "E+F"
    header = ["case", "atoms", "ranks", "ms / evaluation", "speed-up", "|dE|/E vs 1 rank"]
    print_table(f"DFT-D3(BJ, PBE) {what}, two-body {args.cutoff:.2f} Å, CN {CN_CUTOFF:.2f} Å, gloo, 1 thread per rank", header, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
