"""The ``halopipe run`` and ``halopipe verify`` commands, and the embedded demo run.

``run`` validates the configuration in the calling process (so a typo fails
before any process starts), chooses a run directory, then either runs in this
process (one rank), spawns ``N`` local ranks, or, under ``torchrun``/``srun``,
joins the launcher's process group. Each rank executes :func:`run_worker`:
rank 0 builds the system, the simulation scatters it, and all ranks step
together; rank 0 writes the thermo log, trajectory, checkpoint and plot.

``verify`` evaluates the configured composite once distributed and once in a
single process and reports the differences of energies, forces and stress.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig, load_config, parse_config

__all__ = ["run_config", "run_worker", "verify_config", "verify_worker", "choose_run_directory", "DEMO_CONFIG", "run_demo"]

CHECKPOINT, THERMO, TRAJECTORY, PLOT, CONFIG = "checkpoint.pt", "thermo.csv", "trajectory.xyz", "thermo.png", "config.yaml"

DEMO_CONFIG = {
    "name": "demo",
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
flows into the potential (equipartition), leaving a hot (~1000 K) crystal."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# --------------------------------------------------------------- directories
def _candidates(base: Path):
    yield base
    k = 1
    while True:
        yield base.with_name(f"{base.name}.{k}")
        k += 1


def choose_run_directory(base: str | Path, restart: bool) -> Path:
    """A fresh run directory (``base``, ``base.1``, ... the first unused), or for a restart the latest with a checkpoint."""
    base = Path(base)
    if restart:
        found = None
        for path in _candidates(base):
            if not path.exists():
                break
            if (path / CHECKPOINT).is_file():
                found = path
        if found is None:
            raise FileNotFoundError(f"--restart: no {CHECKPOINT} in {base} (or {base.name}.N); run once without --restart first")
        return found
    for path in _candidates(base):
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            path.mkdir(parents=True, exist_ok=True)
            return path
    raise AssertionError("unreachable")


def _write_config(config: RunConfig, directory: Path) -> None:
    import yaml

    data = {k: v for k, v in config.data.items()}
    text = yaml.safe_dump(_plain(data), sort_keys=False)
    (directory / CONFIG).write_text(f"# resolved configuration of {config.source}\n" + text)


def _plain(x):
    """YAML-safe copy: tuples -> lists, tuple keys -> 'Z1-Z2'."""
    if isinstance(x, dict):
        return {("-".join(map(str, k)) if isinstance(k, tuple) else k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# --------------------------------------------------------------------- run
def _reporters(config: RunConfig, directory: Path) -> list:
    from .reporters import EnergyPlot, ProgressBar, ThermoLog, Trajectory

    out = config.outputs
    reporters = []
    if out["thermo_every"]:
        reporters.append(ThermoLog(directory / THERMO, out["thermo_every"], pressure=out["pressure"]))
    if out["trajectory_every"]:
        reporters.append(Trajectory(directory / TRAJECTORY, out["trajectory_every"]))
    if out["progress"]:
        reporters.append(ProgressBar())
    if out["plot"]:
        reporters.append(EnergyPlot(directory / THERMO, directory / PLOT))
    return reporters


def run_worker(data: dict, source: str, directory: str, restart: bool) -> dict:
    """One rank's part of ``halopipe run`` (every rank calls it); returns a summary on rank 0."""
    from .simulation import Simulation

    config = RunConfig(data, source)
    directory = Path(directory)
    pipeline, integrator = config.build_pipeline(), config.build_integrator()
    reporters = _reporters(config, directory)
    checkpoint_every = config.outputs["checkpoint_every"]
    if restart:
        sim = Simulation.restart(
            directory / CHECKPOINT, pipeline, integrator, reporters, checkpoint_every=checkpoint_every, device=config.device
        )
    else:
        system = config.build_system() if _rank() == 0 else None
        sim = Simulation(pipeline, system, integrator, reporters, checkpoint=directory / CHECKPOINT, checkpoint_every=checkpoint_every)
        velocities = config.data["system"].get("velocities")
        if velocities:
            sim.set_velocities(velocities["temperature"], velocities["seed"])
    sim.title = f"{config.name}: {sim.sharded.n_total} atoms, {integrator.describe()}"
    if sim.rank == 0:
        start = f"continuing from step {sim.step}" if restart else "starting"
        print(
            f"halopipe run {config.name}: {sim.sharded.n_total} atoms on {sim.sharded.world_size} rank(s), "
            f"grid {tuple(sim.sharded.grid)}, {integrator.describe()}; {start}, {config.steps} steps in all",
            flush=True,
        )
    t0 = time.perf_counter()
    steps0 = sim.step
    sim.run(max(config.steps - sim.step, 0))
    elapsed = time.perf_counter() - t0
    thermo = sim.thermo()
    rebuilds = int(sim.sharded.all_reduce(torch.tensor([sim.sharded.rebuilds]), "max")[0])
    if sim.rank != 0:
        return {}
    return {
        "name": config.name,
        "directory": str(directory),
        "n_atoms": sim.sharded.n_total,
        "steps": sim.step,
        "ran": sim.step - steps0,
        "seconds": elapsed,
        "thermo": thermo,
        "rebuilds": rebuilds,
        "world_size": sim.sharded.world_size,
        "timestep": integrator.timestep,
        "converged": getattr(integrator, "converged", False),
        "integrator": type(integrator).__name__,
    }


def _drift(path: Path, n_atoms: int) -> float | None:
    """Linear drift of the conserved energy, eV per atom per ps, from a thermo CSV."""
    from .reporters import read_thermo

    if not path.is_file():
        return None
    data = read_thermo(path)
    t, e = data["time_fs"], data["conserved_eV"]
    if len(t) < 3:
        return None
    tm, em = sum(t) / len(t), sum(e) / len(e)
    var = sum((x - tm) ** 2 for x in t)
    slope = sum((x - tm) * (y - em) for x, y in zip(t, e)) / var if var > 0 else 0.0
    return slope * 1000.0 / n_atoms


def _print_summary(result: dict) -> None:
    directory = Path(result["directory"])
    th = result["thermo"]
    rate = result["ran"] / result["seconds"] if result["seconds"] > 0 and result["ran"] else math.nan
    print(f"{result['name']}: {result['n_atoms']} atoms on {result['world_size']} rank(s)")
    print(
        f"finished at step {result['steps']} ({result['ran']} steps, {rate:.1f} steps/s, "
        f"{rate * result['timestep'] * 86400 / 1e6:.3f} ns/day, {result['rebuilds']} neighbour-list rebuilds on the busiest rank)"
    )
    print(
        f"final: T = {th['temperature']:.1f} K, E_pot = {th['potential']:.6f} eV, E_total = {th['total']:.6f} eV, "
        f"conserved = {th['conserved']:.6f} eV"
    )
    drift = _drift(directory / THERMO, result["n_atoms"])
    if drift is not None and result["integrator"] != "FIRE":
        print(f"conserved-energy drift: {drift * 1e3:.3g} meV/atom/ps")
    if result["integrator"] == "FIRE":
        print("FIRE converged" if result["converged"] else "FIRE stopped at the step limit before converging")
    print(f"run directory: {directory}")
    for name in (THERMO, PLOT, TRAJECTORY, CHECKPOINT, CONFIG):
        if (directory / name).is_file():
            print(f"  {name}")


def _spawn_options(config: RunConfig, nproc: int) -> dict:
    return {"backend": "nccl" if config.data["device"] == "cuda" else "gloo", "threads": max(1, (os.cpu_count() or 1) // nproc)}


def run_config(config: RunConfig, nproc: int | None = None, restart: bool = False, output: str | None = None) -> int:
    """Run a validated configuration: here (1 rank), on ``nproc`` spawned ranks, or under torchrun."""
    from ..distributed.launch import init_from_environment, launched_by_runner, spawn

    nproc = nproc or config.nproc
    base = output or config.outputs["directory"]
    if launched_by_runner():
        init_from_environment()
        directory = choose_run_directory(base, restart) if _rank() == 0 else None
        box = [str(directory) if directory else None]
        dist.broadcast_object_list(box, src=0)
        if _rank() == 0 and not restart:
            _write_config(config, Path(box[0]))
        result = run_worker(config.data, config.source, box[0], restart)
        if _rank() == 0:
            _print_summary(result)
        dist.destroy_process_group()
        return 0
    directory = choose_run_directory(base, restart)
    if not restart:
        _write_config(config, directory)
    if nproc == 1:
        result = run_worker(config.data, config.source, str(directory), restart)
    else:
        options = _spawn_options(config, nproc)
        result = spawn(run_worker, nproc, config.data, config.source, str(directory), restart, timeout=math.inf, **options)[0]
    _print_summary(result)
    return 0


def run_demo(nproc: int = 2, atoms: int = 216, steps: int = 300, output: str | None = None) -> int:
    """``halopipe demo``: a short NVE run of the demo composite; prints the run directory with its plot and log."""
    import copy

    from ..demo import cells_for_atoms

    data = copy.deepcopy(DEMO_CONFIG)
    data["system"]["generator"]["cells"] = cells_for_atoms(atoms)
    data["steps"] = int(steps)
    config = parse_config(data, source="demo")
    return run_config(config, nproc=nproc, output=output)


# ------------------------------------------------------------------ verify
def verify_worker(data: dict, source: str) -> dict:
    """Distributed evaluation vs a single process (rank 0); every rank calls it."""
    from ..distributed import ShardedSystem

    config = RunConfig(data, source)
    pipeline = config.build_pipeline()
    rank = _rank()
    system = config.build_system() if rank == 0 else None
    domain = config.domain_config()
    sharded = ShardedSystem.scatter(system, domain)
    stress = bool(sharded.pbc.all())
    reference = pipeline(system, stress=stress, decompose=False) if rank == 0 else None
    distributed = config.build_pipeline()
    t0 = time.perf_counter()
    out = distributed(sharded, stress=stress)
    seconds = time.perf_counter() - t0
    forces = sharded.gather(out["forces"])
    if rank != 0:
        return {}
    result = {
        "n_atoms": system.n_atoms,
        "world_size": sharded.world_size,
        "grid": tuple(sharded.grid),
        "seconds": seconds,
        "energies": {k: (float(out["model_energies"][k]), float(reference["model_energies"][k])) for k in out["model_energies"]},
        "energy": (float(out["energy"]), float(reference["energy"])),
        "force_diff": float((forces.cpu() - reference["forces"].detach().cpu()).abs().max()),
        "force_scale": float(reference["forces"].detach().abs().max()),
        "halo": dict(out["halo"]),
    }
    if stress:
        result["stress_diff"] = float((out["stress"].cpu() - reference["stress"].detach().cpu()).abs().max())
    return result


def _verify_report(r: dict, dtype: torch.dtype) -> bool:
    tol = 1e-8 if dtype == torch.float64 else 1e-3
    print(f"halopipe verify: {r['n_atoms']} atoms, {r['world_size']} rank(s) (grid {r['grid']}) vs 1 process")
    print(f"{'term':<16}{'distributed/eV':>22}{'single/eV':>22}{'|diff|/eV':>12}")
    worst = 0.0
    for name, (a, b) in list(r["energies"].items()) + [("total", r["energy"])]:
        worst = max(worst, abs(a - b) / max(1.0, abs(b)))
        print(f"{name:<16}{a:>22.10f}{b:>22.10f}{abs(a - b):>12.2e}")
    print(f"max |ΔF| = {r['force_diff']:.2e} eV/Å (max |F| = {r['force_scale']:.3g})")
    worst = max(worst, r["force_diff"] / max(1.0, r["force_scale"]))
    if "stress_diff" in r:
        print(f"max |Δstress| = {r['stress_diff']:.2e} eV/Å³")
        worst = max(worst, r["stress_diff"])
    ok = worst <= tol
    print(f"{'OK' if ok else 'MISMATCH'}: largest relative difference {worst:.2e} (tolerance {tol:g})")
    return ok


def verify_config(config: RunConfig, nproc: int | None = None) -> int:
    """Evaluate distributed (``nproc`` ranks) and single-process; print the differences; 0 if they agree."""
    from ..distributed.launch import init_from_environment, launched_by_runner, spawn

    if launched_by_runner():
        init_from_environment()
        result = verify_worker(config.data, config.source)
        ok = _verify_report(result, config.dtype) if _rank() == 0 else True
        dist.destroy_process_group()
        return 0 if ok else 1
    nproc = nproc or (config.nproc if config.nproc > 1 else 2)
    result = spawn(verify_worker, nproc, config.data, config.source, timeout=3600, **_spawn_options(config, nproc))[0]
    return 0 if _verify_report(result, config.dtype) else 1


def load(path: str, steps: int | None = None) -> RunConfig:
    """Load a configuration file, optionally overriding ``steps``."""
    config = load_config(path)
    return config.with_steps(steps) if steps is not None else config


def main_error(prog: str, exc: Exception) -> int:
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return 2
