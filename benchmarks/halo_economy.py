"""Halo economy: per-model halos against one widest halo, and 1-rank overhead.

Part 1 (issue 3): a short-range model (Lennard-Jones, 5 Å) plus a long-range one
(DSF Coulomb, 16 Å) on a ~22k-atom NaCl box, on N ranks: ghost rows per model and
time per evaluation (energy+forces+stress) with ``halo="per_model"`` vs
``halo="max"``; and the 1-rank distributed path against the plain ``Pipeline``.

Part 2 (issue 4): a 5 Å model plus DFT-D3 with its default cutoffs (50.2 Å
two-body, 21.2 Å coordination number) on a liquid-argon-density box.

Times are the best of ``--repeats`` calls: "rebuild" forces a new plan and new
neighbour lists every call (skin 0, moving atoms); "reuse" is the MD steady
state (skin > 0, lists cached).

    python benchmarks/halo_economy.py --nproc 2
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table, rank, timed  # noqa: E402

from halopipe import DFTD3, DSFCoulomb, Group, LennardJones, Pipeline, Step, System  # noqa: E402
from halopipe.demo import demo_system  # noqa: E402
from halopipe.distributed import DomainConfig, ShardedSystem  # noqa: E402
from halopipe.distributed.launch import spawn  # noqa: E402

LJ = dict(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.0, 17: 3.4})


def salt_composite() -> Pipeline:
    return Pipeline([Group([Step(LennardJones(**LJ, cutoff=5.0))], autograd=False), Group([Step(DSFCoulomb(16.0, 0.15))], autograd=True)])


def d3_composite() -> Pipeline:
    return Pipeline([Group([Step(LennardJones(0.0104, 3.4, cutoff=5.0))], autograd=False), Group([Step(DFTD3("pbe"))], autograd=False)])


def argon_liquid(n_cells: int, seed: int = 0) -> System:
    """fcc argon expanded to liquid density (0.021 Å^-3), rattled."""
    from ase.build import bulk

    a = (4 / 0.021) ** (1 / 3)
    atoms = bulk("Ar", "fcc", a=a, cubic=True).repeat((n_cells,) * 3)
    atoms.positions += np.random.default_rng(seed).normal(scale=0.3, size=atoms.positions.shape)
    return System.from_ase(atoms)


def measure(system_fn, pipeline_fn, halo: str, skin: float, repeats: int) -> dict:
    """Time one configuration on the current ranks; returns rank 0's row data."""
    system = system_fn() if rank() == 0 else None
    config = DomainConfig(skin=skin, halo=halo, timeout=1800)
    pipeline = Pipeline(pipeline_fn().groups, config=config)
    sharded = ShardedSystem.scatter(system, config)
    g = torch.Generator().manual_seed(1)
    out = pipeline(sharded, stress=True)  # builds the plan
    if skin == 0.0:

        def step():
            sharded.positions = sharded.positions + 1e-4 * torch.randn(sharded.positions.shape, generator=g, dtype=torch.float64)
            return pipeline(sharded, stress=True)
    else:

        def step():
            return pipeline(sharded, stress=True)

    seconds, out = timed(step, repeats)
    ghosts = {k: v for k, v in out["halo"].items()}
    ghost_max = max_over_ranks([float(ghosts[k]) for k in ghosts])
    return {
        "seconds": max_over_ranks([seconds])[0],
        "ghosts": dict(zip(ghosts, ghost_max)),
        "n": sharded.n_total,
        "energy": float(out["energy"]),
    }


def single_process(system_fn, pipeline_fn, skin: float, repeats: int) -> dict:
    system, pipeline = system_fn(), Pipeline(pipeline_fn().groups, config=DomainConfig(skin=skin))
    pipeline(system, stress=True)
    g = torch.Generator().manual_seed(1)
    state = {"s": system}

    def step():
        if skin == 0.0:
            state["s"] = state["s"].replace(
                positions=state["s"].positions + 1e-4 * torch.randn(system.positions.shape, generator=g, dtype=torch.float64)
            )
        return pipeline(state["s"], stress=True)

    seconds, out = timed(step, repeats)
    return {"seconds": seconds, "energy": float(out["energy"])}


def part1(cells: int, repeats: int) -> list:
    rows = []
    for skin, label in ((0.0, "rebuild"), (1.0, "reuse")):
        for halo in ("per_model", "max"):
            r = measure(lambda: demo_system(cells=cells), salt_composite, halo, skin, repeats)
            rows.append(
                [halo, label, r["n"], int(r["ghosts"]["LennardJones"]), int(r["ghosts"]["DSFCoulomb"]), f"{r['seconds'] * 1e3:.0f}"]
            )
    return rows


def part2(cells: int, repeats: int) -> list:
    rows = []
    for halo in ("per_model", "max"):
        r = measure(lambda: argon_liquid(cells), d3_composite, halo, 1.0, repeats)
        rows.append([halo, "reuse", r["n"], int(r["ghosts"]["LennardJones"]), int(r["ghosts"]["DFTD3"]), f"{r['seconds'] * 1e3:.0f}"])
    return rows


def worker(part: str, cells: int, repeats: int):
    torch.set_num_threads(1)
    return part1(cells, repeats) if part == "1" else part2(cells, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cells", type=int, default=14, help="NaCl conventional cells per edge (14 -> 21952 atoms)")
    parser.add_argument("--argon-cells", type=int, default=6, help="argon fcc cells per edge for the D3 part (6 -> 864 atoms)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-d3", action="store_true")
    args = parser.parse_args()
    header = ["halo", "plan", "atoms", "LJ ghost rows (max rank)", "long-range ghost rows (max rank)", "ms / evaluation"]
    rows = spawn(worker, args.nproc, "1", args.cells, args.repeats, timeout=3600)[0]
    print_table(f"Part 1: LJ 5 Å (direct) + DSF Coulomb 16 Å (autograd), {args.nproc} ranks, float64, E+F+stress", header, rows)

    torch.set_num_threads(1)
    one = spawn(measure_one_rank, 1, args.cells, args.repeats, timeout=3600)[0]
    print_table("Part 1b: 1-rank distributed path vs plain single-process Pipeline (1 thread)", ["path", "plan", "ms / evaluation"], one)
    if not args.skip_d3:
        rows = spawn(worker, args.nproc, "2", args.argon_cells, args.repeats, timeout=3600)[0]
        header[4] = "D3 ghost rows (max rank)"
        print_table(f"Part 2: LJ 5 Å + DFT-D3(PBE, BJ, default cutoffs 50.2/21.2 Å), liquid argon, {args.nproc} ranks", header, rows)


def measure_one_rank(cells: int, repeats: int) -> list:
    torch.set_num_threads(1)
    rows = []
    for skin, label in ((0.0, "rebuild"), (1.0, "reuse")):
        d = measure(lambda: demo_system(cells=cells), salt_composite, "per_model", skin, repeats)
        s = single_process(lambda: demo_system(cells=cells), salt_composite, skin, repeats)
        rows.append(["Pipeline on a ShardedSystem, 1 rank", label, f"{d['seconds'] * 1e3:.0f}"])
        rows.append(["Pipeline (single process)", label, f"{s['seconds'] * 1e3:.0f}"])
    return rows


if __name__ == "__main__":
    main()
