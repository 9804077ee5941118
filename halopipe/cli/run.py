"""``halopipe run`` and ``halopipe verify``: run a configured simulation, or check it distributed against one process.

``run`` validates the configuration in the calling process (so a typo fails
before any process starts), claims a run directory (see
:mod:`~halopipe.cli.rundir`), checks a restart (readable checkpoint, steps
left, same physics), then either runs in this process (one rank), spawns ``N``
local ranks, or, under ``torchrun``/``srun``, joins the launcher's process
group. Each rank executes :func:`run_worker`: rank 0 builds the system, the
simulation scatters it, and all ranks step together; rank 0 writes the thermo
log, trajectory, checkpoint and plot.

``verify`` evaluates the configured composite once distributed and once in a
single process and reports the differences of energies, forces and stress.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..distributed.launch import init_from_environment, launched_by_runner, spawn
from ..dynamics.simulation import CheckpointMismatch, load_checkpoint, restart_changes
from .report import clock, note, set_clock, warn
from .rundir import CHECKPOINT, claim_run_directory

__all__ = ["run_config", "run_worker", "verify_config", "verify_worker", "check_cores"]

THERMO, TRAJECTORY, PLOT, CONFIG, CHANGES = "thermo.csv", "trajectory.xyz", "thermo.png", "config.yaml", "changes.log"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check_cores(prog: str, nproc: int) -> None:
    """Warn when ``nproc`` ranks exceed the cores this process may use (they would share cores and run slower)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > cores:
        warn(prog, f"--nproc {nproc} exceeds the {cores} CPU core(s) available; ranks will share cores and run slower")


def _spawn_options(config: RunConfig, nproc: int) -> dict:
    return {"backend": "nccl" if config.data["device"] == "cuda" else "gloo", "threads": max(1, (os.cpu_count() or 1) // nproc)}


# ------------------------------------------------------------ before the run
def _write_config(config: RunConfig, directory: Path) -> None:
    import yaml

    text = yaml.safe_dump(_plain(config.data), sort_keys=False)
    (directory / CONFIG).write_text(f"# resolved configuration of {config.source}\n" + text)


def _plain(x):
    """YAML-safe copy: tuples -> lists, tuple keys -> 'Z1-Z2'."""
    if isinstance(x, dict):
        return {("-".join(map(str, k)) if isinstance(k, tuple) else k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _check_restart(config: RunConfig, directory: Path, allow_changed: bool) -> bool:
    """Check a restart before any rank starts; ``False`` when there is nothing to do.

    The checkpoint must be readable and its physics equal the configuration's
    (or ``allow_changed``, in which case the changes are appended to
    ``changes.log`` in the run directory).
    """
    path = directory / CHECKPOINT
    state = load_checkpoint(path)
    if state["step"] >= config.steps:
        print(f"halopipe run: {directory} is at step {state['step']} of {config.steps}: nothing to do; raise --steps to continue")
        return False
    changes = restart_changes(state, config.build_pipeline(), config.build_integrator(), config.build_system())
    if changes and not allow_changed:
        raise CheckpointMismatch(path, changes)
    if changes:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(directory / CHANGES, "a") as log:
            log.write(f"{stamp} restart at step {state['step']} with --allow-changed ({config.source}):\n")
            log.writelines(f"  {c}\n" for c in changes)
        warn("halopipe run", f"continuing with changed physics ({'; '.join(changes)}); logged in {directory / CHANGES}")
    return True


# ------------------------------------------------------------------- the run
def _reporters(config: RunConfig, directory: Path) -> list:
    from ..dynamics.reporters import EnergyPlot, ProgressBar, ThermoLog, Trajectory

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


def _simulation(config: RunConfig, directory: Path, restart: bool, allow_changed: bool):
    from ..dynamics.simulation import Simulation

    pipeline, integrator = config.build_pipeline(), config.build_integrator()
    reporters = _reporters(config, directory)
    every = config.outputs["checkpoint_every"]
    note("building the system" + (" and reading the checkpoint" if restart else ""))
    system = config.build_system() if _rank() == 0 else None
    note(f"scattering the system over {dist.get_world_size() if dist.is_initialized() else 1} rank(s)")
    if restart:
        return Simulation.restart(
            directory / CHECKPOINT,
            pipeline,
            integrator,
            reporters,
            checkpoint_every=every,
            device=config.device,
            system=system,
            allow_changed=allow_changed,
        )
    sim = Simulation(pipeline, system, integrator, reporters, checkpoint=directory / CHECKPOINT, checkpoint_every=every)
    velocities = config.data["system"].get("velocities")
    if velocities:
        sim.set_velocities(velocities["temperature"], velocities["seed"])
    return sim


def run_worker(data: dict, source: str, directory: str, restart: bool, allow_changed: bool = False, t0: float | None = None) -> dict:
    """One rank's part of ``halopipe run`` (every rank calls it); returns a summary on rank 0."""
    if t0 is not None:
        set_clock(t0)
    config = RunConfig(data, source)
    directory = Path(directory)
    sim = _simulation(config, directory, restart, allow_changed)
    integrator = sim.integrator
    sim.title = f"{config.name}: {sim.sharded.n_total} atoms, {integrator.describe()}"
    start = f"continuing from step {sim.step}" if restart else "starting"
    note(
        f"{config.name}: {sim.sharded.n_total} atoms on {sim.sharded.world_size} rank(s), grid {tuple(sim.sharded.grid)}, "
        f"{integrator.describe()}; {start}, {config.steps} steps in all"
    )
    note("first evaluation (builds neighbour lists and halos), then stepping")
    sim.run(max(config.steps - sim.step, 0))
    thermo = sim.thermo()
    rebuilds = int(sim.sharded.all_reduce(torch.tensor([sim.sharded.rebuilds]), "max")[0])
    compilations = int(sim.sharded.all_reduce(torch.tensor([sim.potential.compilations]), "max")[0])
    if sim.rank != 0:
        return {}
    return {
        "name": config.name,
        "directory": str(directory),
        "n_atoms": sim.sharded.n_total,
        "steps": sim.step,
        "ran": sim.timing.steps,
        "seconds": sim.timing.seconds,
        "thermo": thermo,
        "rebuilds": rebuilds,
        "compilations": compilations,
        "world_size": sim.sharded.world_size,
        "timestep": integrator.timestep,
        "converged": getattr(integrator, "converged", False),
        "integrator": type(integrator).__name__,
    }


# --------------------------------------------------------------- the summary
def _drift(path: Path, n_atoms: int) -> float | None:
    """Linear drift of the conserved energy, eV per atom per ps, from a thermo CSV."""
    import numpy as np

    from ..dynamics.reporters import read_thermo

    if not path.is_file():
        return None
    data = read_thermo(path)
    if len(data["time_fs"]) < 3:
        return None
    slope = np.polyfit(np.asarray(data["time_fs"]), np.asarray(data["conserved_eV"]), 1)[0]
    return float(slope) * 1000.0 / n_atoms


def _print_summary(result: dict) -> None:
    directory = Path(result["directory"])
    th = result["thermo"]
    rate = result["ran"] / result["seconds"]
    print(f"{result['name']}: {result['n_atoms']} atoms on {result['world_size']} rank(s)")
    print(
        f"finished at step {result['steps']} ({result['ran']} steps in {result['seconds']:.1f} s, {rate:.1f} steps/s, "
        f"{rate * result['timestep'] * 86400 / 1e6:.3f} ns/day, {result['rebuilds']} neighbour-list rebuilds on the busiest rank)"
    )
    if result.get("compilations"):
        print(f"torch.compile: {result['compilations']} graphs compiled on the busiest rank (first compiles and recompiles)")
    print(
        f"final: T = {th['temperature']:.1f} K, E_pot = {th['potential']:.6f} eV, E_total = {th['total']:.6f} eV, "
        f"conserved = {th['conserved']:.6f} eV"
    )
    if math.isfinite(th.get("density", math.nan)):  # NaN unless periodic
        print(f"final cell: V = {th['volume']:.2f} Å³, density = {th['density']:.4f} g/cm³")
    drift = _drift(directory / THERMO, result["n_atoms"])
    if drift is not None and result["integrator"] != "FIRE":
        print(f"conserved-energy drift: {drift * 1e3:.3g} meV/atom/ps")
    if result["integrator"] == "FIRE":
        print("FIRE converged" if result["converged"] else "FIRE stopped at the step limit before converging")
    print(f"run directory: {directory}")
    for name in (THERMO, PLOT, TRAJECTORY, CHECKPOINT, CONFIG, CHANGES):
        if (directory / name).is_file():
            print(f"  {name}")


# -------------------------------------------------------------- entry points
def _prepare(config: RunConfig, directory: Path, restart: bool, allow_changed: bool) -> bool:
    """Restart checks or the resolved config file; ``False`` when there is nothing to do."""
    if restart:
        return _check_restart(config, directory, allow_changed)
    _write_config(config, directory)
    return True


def _run_under_runner(config: RunConfig, base: str, restart: bool, allow_changed: bool) -> int:
    """Under torchrun/srun: rank 0 claims the directory and checks; every rank learns the outcome, then all run."""
    init_from_environment()
    try:
        with ExitStack() as held:
            failure, outcome = None, [None, False, False]  # directory, proceed, failed
            if _rank() == 0:
                try:
                    directory = held.enter_context(claim_run_directory(base, restart))
                    outcome = [str(directory), _prepare(config, directory, restart, allow_changed), False]
                except Exception as exc:
                    failure, outcome = exc, [None, False, True]
            dist.broadcast_object_list(outcome, src=0)  # no rank waits on a rank 0 that failed
            if failure is not None:
                raise failure
            if outcome[2]:
                return 1  # rank 0 reports the failure
            if outcome[1]:
                result = run_worker(config.data, config.source, outcome[0], restart, allow_changed)
                if _rank() == 0:
                    _print_summary(result)
    finally:
        dist.destroy_process_group()
    return 0


def run_config(
    config: RunConfig, nproc: int | None = None, restart: bool = False, output: str | None = None, allow_changed: bool = False
) -> int:
    """Run a validated configuration: here (1 rank), on ``nproc`` spawned ranks, or under torchrun."""
    base = output or config.outputs["directory"]
    if launched_by_runner():
        return _run_under_runner(config, base, restart, allow_changed)
    nproc = nproc or config.nproc
    check_cores("halopipe run", nproc)
    with claim_run_directory(base, restart) as directory:
        if not _prepare(config, directory, restart, allow_changed):
            return 0
        args = (config.data, config.source, str(directory), restart, allow_changed, clock())
        if nproc == 1:
            result = run_worker(*args)
        else:
            note(f"starting {nproc} ranks")
            result = spawn(run_worker, nproc, *args, timeout=float("inf"), **_spawn_options(config, nproc))[0]
    _print_summary(result)
    return 0


# -------------------------------------------------------------------- verify
def verify_worker(data: dict, source: str) -> dict:
    """Distributed evaluation vs a single process (rank 0); every rank calls it."""
    from ..distributed import ShardedSystem

    config = RunConfig(data, source)
    pipeline = config.build_pipeline()
    rank = _rank()
    system = config.build_system() if rank == 0 else None
    sharded = ShardedSystem.scatter(system, pipeline.config)
    stress = bool(sharded.pbc.all())
    # The same pipeline object serves both: its caches key on each domain's own plan.
    reference = pipeline(system, stress=stress, decompose=False) if rank == 0 else None
    t0 = time.perf_counter()
    out = pipeline(sharded, stress=stress)
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
    if launched_by_runner():
        init_from_environment()
        try:
            result = verify_worker(config.data, config.source)
            ok = _verify_report(result, config.dtype) if _rank() == 0 else True
            # Ranks leave together: a rank that tears gloo down while rank 0 still evaluates its single-process
            # reference was seen to abort in the teardown and hang rank 0's launcher.
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return 0 if ok else 1
    nproc = nproc or (config.nproc if config.nproc > 1 else 2)
    check_cores("halopipe verify", nproc)
    note(f"starting {nproc} ranks")
    result = spawn(verify_worker, nproc, config.data, config.source, timeout=3600, **_spawn_options(config, nproc))[0]
    return 0 if _verify_report(result, config.dtype) else 1
