"""``halopipe demo --nproc N``: the demo composite on N ranks, checked against one process."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .launch import init_from_environment, launched_by_runner, spawn
from .sharded import ShardedSystem

__all__ = ["run_distributed_demo", "demo_worker"]


def demo_worker(atoms: int, repeats: int) -> dict:
    """One rank's part of the demo: evaluate, compare with one process on rank 0, time."""
    from ..demo import cells_for_atoms, demo_pipeline, demo_system

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
        "halo_keys": list(out["halo"]),
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


def run_distributed_demo(nproc: int, atoms: int, repeats: int) -> int:
    """Spawn ``nproc`` local ranks (or use torchrun's), run the demo and print the table on rank 0."""
    if launched_by_runner():
        init_from_environment()
        result = demo_worker(atoms, repeats)
        if dist.get_rank() == 0:
            _print_table(result)
        dist.destroy_process_group()
        return 0
    results = spawn(demo_worker, nproc, atoms, repeats, timeout=1800)
    _print_table(results[0])
    return 0
