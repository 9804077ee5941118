"""Recompilations of a compiled MLIP over a long MD run with rebuilds and migration.

A carbon Lennard-Jones liquid (argon's parameters, carbon's mass: fast atoms,
so lists rebuild and atoms change ranks often) plus a compiled random-weight
MACE (16x0e+16x1o, 2 layers, r_max 5 Å, its interaction energy scaled down so
the liquid stays a liquid), Langevin at 300 K on ``--nproc`` ranks, float64.
Every rebuild changes the atom, ghost and edge counts of each rank's view.
Reports the graphs compiled after the first step and at the end (largest rank),
the rebuilds, and seconds per step.

    OMP_NUM_THREADS=1 python benchmarks/compile_md.py --steps 1000 --nproc 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table  # noqa: E402
from mlip_halo import build_mace  # noqa: E402


def carbon_liquid(n_atoms: int, density: float = 0.0213, seed: int = 0):
    """Jittered simple-cubic carbon at ``density`` atoms/Å³ (liquid argon's)."""
    from halopipe import System

    side = round(n_atoms ** (1 / 3))
    length = (side**3 / density) ** (1 / 3)
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    positions = (grid + rng.uniform(-0.1, 0.1, grid.shape)) * (length / side)
    return System(
        positions=torch.tensor(positions), numbers=torch.full((len(positions),), 6), cell=torch.eye(3, dtype=torch.float64) * length
    )


def run(n_atoms: int, steps: int) -> dict:
    from halopipe import MACE, DomainConfig, LennardJones, Pipeline
    from halopipe.dynamics import Langevin, Simulation

    torch.set_num_threads(1)
    module = build_mace(channels=16)
    module.scale_shift.scale.fill_(1e-3)  # random weights: keep the network's forces small against LJ's
    pipeline = Pipeline([LennardJones(0.0104, 3.4, cutoff=8.5), MACE(module)], DomainConfig(skin=0.5), compile=True)
    system = carbon_liquid(n_atoms)
    sim = Simulation(pipeline, system, Langevin(1.0, 300.0, friction=0.01, seed=1))
    sim.set_velocities(300.0, seed=1)
    sim.run(1)
    first = pipeline.compilations
    t0 = time.perf_counter()
    sim.run(steps - 1)
    seconds = time.perf_counter() - t0
    first, last, seconds = max_over_ranks([first, pipeline.compilations, seconds])
    rebuilds = int(max_over_ranks([sim.sharded.rebuilds])[0])
    return {"n": sim.sharded.n_total, "first": int(first), "last": int(last), "rebuilds": rebuilds, "seconds": seconds / (steps - 1)}


def main() -> None:
    from halopipe.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=343)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    r = spawn(run, args.nproc, args.atoms, args.steps, timeout=7200)[0]
    print_table(
        f"Compiled MACE + LJ, carbon liquid, Langevin 300 K, dt 1 fs, {args.steps} steps, {args.nproc} ranks",
        ["atoms", "rebuilds", "graphs after step 1", "graphs after the run", "recompilations", "s / step"],
        [[r["n"], r["rebuilds"], r["first"], r["last"], r["last"] - r["first"], f"{r['seconds']:.3f}"]],
    )


if __name__ == "__main__":
    main()
