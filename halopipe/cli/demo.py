"""``halopipe demo``: the demo composite, as a short MD run or (``--evaluate``) as one checked evaluation.

The MD run is :data:`DEMO_CONFIG` handed to :func:`~halopipe.cli.run.run_config`.
``--evaluate`` times one energy+forces+stress evaluation of
:func:`~halopipe.demo.demo_pipeline` on :func:`~halopipe.demo.demo_system`:
on one process it checks the forces against a finite difference of the
energy; on ``N`` ranks it compares every term with one process.
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.distributed as dist

from ..demo import cells_for_atoms, demo_pipeline, demo_system
from ..distributed import ShardedSystem
from ..distributed.launch import init_from_environment, launched_by_runner, spawn
from ..dynamics.units import EV_PER_A3_TO_GPA
from .report import note

__all__ = ["DEMO_CONFIG", "run_demo", "evaluate_demo", "evaluate_worker", "directional_force_check", "time_call"]

DEMO_CONFIG = {
    "name": "halopipe-demo",
    "system": {"generator": {"type": "nacl", "cells": 3, "rattle": 0.1}, "velocities": {"temperature": 2000.0, "seed": 1}},
    "models": {
        "lj": {"type": "LennardJones", "epsilon": {"Na": 0.0115, "Cl": 0.0043}, "sigma": {"Na": 2.0, "Cl": 3.4}, "cutoff": 8.0},
        "charges": {"type": "ChargeModel", "cutoff": 4.0, "coordination_weight": 0.02},
        "coulomb": {"type": "DSFCoulomb", "cutoff": 10.0, "alpha": 0.2},
    },
    "groups": [{"steps": ["lj"], "autograd": False}, {"steps": ["charges", "coulomb"], "autograd": True}],
    "domain": {"skin": 1.0},
    "integrator": {"type": "velocity_verlet", "timestep": 1.0},
    "steps": 300,
    "nproc": 2,
    "outputs": {"thermo_every": 5, "trajectory_every": 50, "checkpoint_every": 100},
}
"""The embedded configuration of ``halopipe demo``: the demo composite (ChargeModel -> DSFCoulomb wired, plus
Lennard-Jones) on a 216-atom NaCl box, NVE on 2 processes: velocities drawn at 2000 K, half of the kinetic energy
flows into the potential (equipartition), leaving a hot (~1000 K) crystal. Its run directory, ``runs/halopipe-demo``,
is not that of ``examples/demo.yaml`` (``runs/demo``)."""


def run_demo(nproc: int = 2, atoms: int = 216, steps: int = 300, output: str | None = None) -> int:
    """``halopipe demo``: a short NVE run of the demo composite; prints the run directory with its plot and log."""
    from ..config import parse_config
    from .run import run_config

    data = copy.deepcopy(DEMO_CONFIG)
    data["system"]["generator"]["cells"] = cells_for_atoms(atoms)
    data["steps"] = int(steps)
    note("checking the demo configuration")
    return run_config(parse_config(data, source="demo"), nproc=nproc, output=output)


# ----------------------------------------------------------------- --evaluate
def directional_force_check(pipeline, system, h: float = 1e-4, seed: int = 0) -> tuple[float, float]:
    """Compare ``-F . d`` with a central difference of E along a random unit direction ``d``.

    Returns (directional derivative from forces, from finite differences).
    """
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(system.positions.shape, generator=g, dtype=system.dtype)
    d /= d.norm()
    forces = pipeline(system)["forces"]
    e_plus = float(pipeline(system.replace(positions=system.positions + h * d))["energy"])
    e_minus = float(pipeline(system.replace(positions=system.positions - h * d))["energy"])
    return float(-(forces * d).sum()), (e_plus - e_minus) / (2 * h)


def time_call(fn, repeats: int = 3) -> float:
    """Best wall time (s) of ``fn()`` over ``repeats`` calls."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _evaluate_single(atoms: int, repeats: int) -> int:
    system = demo_system(cells=cells_for_atoms(atoms))
    pipeline = demo_pipeline()
    print(f"halopipe demo: {system.n_atoms} atoms (NaCl melt-like box), 1 process, float64")
    first = time_call(lambda: pipeline(system, stress=True), 1)  # builds the ghost plan and neighbour lists
    out = pipeline(system, stress=True)
    seconds = time_call(lambda: pipeline(system, stress=True), repeats)  # plan and lists reused, as in MD within the skin
    models = [s.model for g in pipeline.groups for s in g.steps]
    names = [n for row in pipeline.names for n in row]
    print(f"{'model':<14}{'cutoff/Å':>10}{'energy/eV':>18}")
    for name, model in zip(names, models):
        print(f"{name:<14}{model.cutoff:>10.2f}{float(out['model_energies'][name]):>18.6f}")
    print(f"{'total':<14}{'':>10}{float(out['energy']):>18.6f}")
    pressure = -torch.trace(out["stress"]) / 3 * EV_PER_A3_TO_GPA
    print(f"pressure: {float(pressure):.4f} GPa;  charges sum to {float(out['fields']['charges'].sum()):.2e} e")
    analytic, numeric = directional_force_check(pipeline, system)
    print(f"force check: -F.d = {analytic:.9f}, finite difference dE/dd = {numeric:.9f} (diff {abs(analytic - numeric):.2e} eV/Å)")
    print(f"time per evaluation (energy+forces+stress): {first * 1e3:.1f} ms building plan and lists, {seconds * 1e3:.1f} ms reusing them")
    return 0


def evaluate_worker(atoms: int, repeats: int) -> dict:
    """One rank's part of ``demo --evaluate``: evaluate, compare with one process on rank 0, time."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    pipeline = demo_pipeline()
    system = demo_system(cells=cells_for_atoms(atoms)) if rank == 0 else None
    reference = pipeline(system, stress=True, decompose=False) if rank == 0 else None
    sharded = ShardedSystem.scatter(system, pipeline.config)
    t0 = time.perf_counter()
    out = pipeline(sharded, stress=True)  # builds the ghost plan and neighbour lists
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        pipeline(sharded, stress=True)
        best = min(best, time.perf_counter() - t0)
    forces = sharded.gather(out["forces"])
    ghosts = sharded.all_reduce(
        torch.tensor([[out["halo"][k] for k in out["halo"]]], dtype=torch.float64).repeat(sharded.world_size, 1)
        * (torch.arange(sharded.world_size) == sharded.rank)[:, None]
    )
    times = sharded.all_reduce(torch.tensor([best, first], dtype=torch.float64), "max")
    if rank != 0:
        return {}
    models = [s.model for g in pipeline.groups for s in g.steps]
    return {
        "n_atoms": system.n_atoms,
        "grid": sharded.grid,
        "names": list(out["model_energies"]),
        "cutoffs": [m.cutoff for m in models],
        "energies": {k: float(v) for k, v in out["model_energies"].items()},
        "reference": {k: float(v) for k, v in reference["model_energies"].items()},
        "energy": float(out["energy"]),
        "reference_energy": float(reference["energy"]),
        "force_diff": float((forces - reference["forces"]).abs().max()),
        "stress_diff": float((out["stress"] - reference["stress"]).abs().max()),
        "ghosts": ghosts.tolist(),
        "seconds": float(times[0]),
        "first_seconds": float(times[1]),
    }


def _print_table(r: dict) -> None:
    nproc = len(r["ghosts"])
    print(f"halopipe demo: {r['n_atoms']} atoms on {nproc} ranks, grid {tuple(r['grid'])}, float64")
    print(f"{'model':<14}{'cutoff/Å':>9}{'ghost rows per rank':>26}{'energy/eV':>18}{'|ΔE| vs 1 proc':>16}")
    for k, name in enumerate(r["names"]):
        rows = [int(g[k]) for g in r["ghosts"]]
        shown = ", ".join(map(str, rows)) if nproc <= 4 else f"mean {sum(rows) / nproc:.0f}, max {max(rows)}"
        print(
            f"{name:<14}{r['cutoffs'][k]:>9.2f}{shown:>26}{r['energies'][name]:>18.6f}"
            f"{abs(r['energies'][name] - r['reference'][name]):>16.2e}"
        )
    print(f"{'total':<14}{'':>9}{'':>26}{r['energy']:>18.6f}{abs(r['energy'] - r['reference_energy']):>16.2e}")
    print(f"max |ΔF| vs single process: {r['force_diff']:.2e} eV/Å;  max |Δstress|: {r['stress_diff']:.2e} eV/Å³")
    print(
        f"time per evaluation (energy+forces+stress, slowest rank): {r['first_seconds'] * 1e3:.1f} ms building plan and lists, "
        f"{r['seconds'] * 1e3:.1f} ms reusing them"
    )


def evaluate_demo(nproc: int, atoms: int, repeats: int) -> int:
    """``halopipe demo --evaluate``: one process, ``nproc`` spawned ranks, or the ranks of torchrun."""
    if launched_by_runner():
        init_from_environment()
        try:
            result = evaluate_worker(atoms, repeats)
            if dist.get_rank() == 0:
                _print_table(result)
        finally:
            dist.destroy_process_group()
        return 0
    if nproc == 1:
        return _evaluate_single(atoms, repeats)
    note(f"starting {nproc} ranks")
    _print_table(spawn(evaluate_worker, nproc, atoms, repeats, timeout=1800)[0])
    return 0
