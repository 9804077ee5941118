"""Running dynamics: the :class:`Simulation` loop, checkpoints and restarts.

A simulation scatters a system over the ranks once (a single process is just
one rank: the same code path), then repeats ``integrator.step``: the
integrator moves owned atoms and calls the distributed potential, which
reuses neighbour lists and halos until some atom moved half the skin, and then
rebuilds them and migrates atoms to their new owners. Every ``K`` steps, and at
the end, a checkpoint is written: full arrays in the original atom order
(gathered), so a run may continue on a different number of ranks, plus the
step, time and the integrator's state. Random numbers are counter based, so
the seed and the step number are the whole generator state. A checkpoint is
written to a temporary file and renamed over the old one (``os.replace`` is
atomic), so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import ShardedSystem
from ..models.base import Model
from ..pipeline import Pipeline
from ..system import System
from .collection import scheduled_collection
from .fingerprint import fingerprint_changes, integrator_fingerprint, pipeline_fingerprint, system_identity
from .integrators import Integrator, MDState
from .units import AMU_PER_A3_TO_G_PER_CM3, EV_PER_A3_TO_GPA, KB
from .velocities import maxwell_boltzmann

__all__ = [
    "Simulation",
    "RunTiming",
    "CheckpointError",
    "CheckpointMismatch",
    "restart_changes",
    "atomic_save",
    "load_checkpoint",
    "checkpoint_system",
    "CHECKPOINT_FORMAT",
]

CHECKPOINT_FORMAT = "halopipe-md-checkpoint/2"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read: empty, truncated, corrupt, or not a halopipe MD checkpoint."""


class CheckpointMismatch(ValueError):
    """A restart whose physics (system, models, groups, integrator) differs from the checkpoint's."""

    def __init__(self, path: str | Path, changes: list[str]) -> None:
        super().__init__(
            f"{path} was written with other physics: " + "; ".join(changes) + ". "
            "Restore the configuration, start a new run without --restart, or continue anyway with --restart --allow-changed"
        )
        self.changes = changes


@dataclass
class RunTiming:
    """Wall time of the stepping loop of the latest :meth:`Simulation.run` (setup and the first evaluation excluded).

    Progress bars and run summaries both read it, so they report the same rate.
    """

    first_step: int
    target_step: int
    started: float | None = None
    """``time.perf_counter()`` when the loop began (``None`` during setup)."""
    steps: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Steps per second of the loop so far (NaN before the first step)."""
        return self.steps / self.seconds if self.steps and self.seconds > 0 else math.nan

    def tick(self, step: int) -> None:
        """Record that the loop has reached ``step``."""
        self.steps = step - self.first_step
        self.seconds = time.perf_counter() - self.started


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_from_rank0(value):
    """``value`` of rank 0 on every rank (identity on one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _species_counts(numbers: torch.Tensor) -> torch.Tensor:
    return torch.bincount(numbers.to(torch.int64).cpu(), minlength=119)


def _identity(system: System) -> dict:
    return system_identity(system.n_atoms, _species_counts(system.numbers), system.cell, system.pbc)


def _prefix_step(exc: Exception, step: int) -> None:
    """Name the MD step in an error raised while computing it (type and traceback kept)."""
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("MD step"):
        exc.args = (f"MD step {step}: {exc.args[0]}", *exc.args[1:])


def _as_pipeline(model) -> Pipeline:
    """A Model or Pipeline -> the Pipeline whose config (skin, grid) the simulation uses."""
    if isinstance(model, Model):
        return Pipeline([model])
    if not isinstance(model, Pipeline):
        raise TypeError(f"Simulation: expected a Model or Pipeline, got {type(model).__name__}")
    return model


def _with_velocities(system: System) -> System:
    if "velocities" in system.fields:
        v = system.fields["velocities"]
        if tuple(v.shape) != (system.n_atoms, 3):
            raise ValueError(f"Simulation: field 'velocities' must have shape ({system.n_atoms}, 3), got {tuple(v.shape)}")
        return system
    fields = dict(system.fields)
    fields["velocities"] = torch.zeros_like(system.positions)
    return system.replace(fields=fields)


class Simulation:
    """Molecular dynamics (or FIRE minimisation) of a system under a potential.

    Parameters
    ----------
    model : a :class:`~halopipe.models.Model` or :class:`~halopipe.Pipeline`;
        the pipeline's ``config`` gives the skin and the brick grid.
    system : the :class:`~halopipe.System` (needed on rank 0; other ranks may
        pass it or ``None``) or an already scattered
        :class:`~halopipe.distributed.ShardedSystem`. Velocities (Å/fs) are
        taken from its ``velocities`` field, zero if absent.
    integrator : an :class:`~halopipe.dynamics.integrators.Integrator`.
    reporters : objects with ``start``/``report``/``finish`` (see
        :mod:`halopipe.dynamics.reporters`).
    checkpoint : path of the checkpoint file, or ``None`` for none.
    checkpoint_every : write it every this many steps (0: only at the end).

    Every rank constructs the simulation and calls :meth:`run` (collective).
    """

    def __init__(
        self,
        model,
        system,
        integrator: Integrator,
        reporters=(),
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        if not isinstance(integrator, Integrator):
            raise TypeError(f"Simulation: integrator must be an Integrator, got {type(integrator).__name__}")
        if not (isinstance(checkpoint_every, int) and checkpoint_every >= 0):
            raise ValueError(f"Simulation: checkpoint_every must be an integer >= 0, got {checkpoint_every!r}")
        self.potential = _as_pipeline(model)
        self.config = self.potential.config
        self.integrator = integrator
        self.reporters = list(reporters)
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.checkpoint_every = checkpoint_every
        self.sharded = self._shard(system)
        self.md = MDState(self.sharded, self.potential)
        self.fingerprint = self._fingerprint()
        self.changes: list[str] = []
        self.restarted = False
        self.timing: RunTiming | None = None
        self._started = False
        self._last_checkpoint = -1

    def _fingerprint(self) -> dict:
        """The physics of this run (collective: species are counted over all ranks)."""
        sh = self.sharded
        counts = sh.all_reduce(_species_counts(sh.numbers).to(sh.positions.device))
        models, groups = pipeline_fingerprint(self.potential)
        return {
            "system": system_identity(sh.n_total, counts, sh.cell, sh.pbc),
            "models": models,
            "groups": groups,
            "integrator": integrator_fingerprint(self.integrator),
        }

    def _shard(self, system) -> ShardedSystem:
        if isinstance(system, ShardedSystem):
            if "velocities" not in system.schema:
                system.schema["velocities"] = ((3,), system.positions.dtype)
                system.fields["velocities"] = torch.zeros_like(system.positions)
            return system
        if _rank() == 0 and isinstance(system, System):
            system = _with_velocities(system)
        # scatter checks the input on every rank and agrees, so a bad system on rank 0 ends all ranks with one error.
        return ShardedSystem.scatter(system if _rank() == 0 else None, self.config)

    # ------------------------------------------------------------ restart
    @classmethod
    def restart(
        cls,
        path: str | Path,
        model,
        integrator: Integrator,
        reporters=(),
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 0,
        device: str | torch.device | None = None,
        system: System | None = None,
        allow_changed: bool = False,
    ) -> Simulation:
        """Continue from the checkpoint at ``path`` (on any number of ranks).

        The run then continues exactly as if uninterrupted: positions,
        velocities, the step, and the integrator's state (thermostat
        variables, the noise counter) come from the checkpoint.

        Parameters
        ----------
        system : the system this run was configured with (rank 0); its
            identity (atom count, species, cell, pbc) is checked against the
            checkpoint's. ``None``: not checked.
        allow_changed : continue although the physics differs from the
            checkpoint's; the differences are in :attr:`changes`.

        Raises
        ------
        FileNotFoundError, CheckpointError : no readable checkpoint at ``path``.
        CheckpointMismatch : the models, groups, integrator or configured
            system differ from the checkpoint's and ``allow_changed`` is false.
        ValueError : another integrator type (its state cannot be continued).
        """
        potential = _as_pipeline(model)
        state, verdict = None, None
        if _rank() == 0:
            try:
                state = load_checkpoint(path)
                verdict = {"changes": restart_changes(state, potential, integrator, system)}
            except (FileNotFoundError, CheckpointError) as exc:
                verdict = {"error": type(exc).__name__, "message": str(exc)}
        verdict = _broadcast_from_rank0(verdict)  # every rank raises the same error, none waits
        if "error" in verdict:
            raise {"FileNotFoundError": FileNotFoundError, "CheckpointError": CheckpointError}[verdict["error"]](verdict["message"])
        changes = verdict["changes"]
        kind = next((c for c in changes if c.startswith("integrator.type:")), None)
        if kind is not None:
            raise ValueError(
                f"Simulation.restart: {path} was written by another integrator ({kind}); "
                "a restart continues the same run (start a new run from the checkpoint's structure instead)"
            )
        if changes and not allow_changed:
            raise CheckpointMismatch(path, changes)
        system_now = checkpoint_system(state, device=device) if state is not None else None
        sim = cls(potential, system_now, integrator, reporters, checkpoint if checkpoint is not None else path, checkpoint_every)
        head = None
        if state is not None:
            head = {"step": state["step"], "time": state["time"], "integrator": state["integrator"], "system": state["physics"]["system"]}
        head = sim.sharded.comm.broadcast_object(head, src=0)
        # The configured system's identity, not the checkpoint's current cell (a barostat moves it).
        sim.fingerprint["system"] = head["system"]
        sim.md.step, sim.md.time = int(head["step"]), float(head["time"])
        integrator.load_state_dict(head["integrator"]["state"], sim.md)
        sim.changes = changes
        sim.restarted = True
        sim._last_checkpoint = sim.md.step
        return sim

    # ---------------------------------------------------------- properties
    @property
    def step(self) -> int:
        return self.md.step

    @property
    def time(self) -> float:
        """Simulated time, fs."""
        return self.md.time

    @property
    def rank(self) -> int:
        return self.sharded.rank

    def set_velocities(self, temperature: float, seed: int = 0, exact: bool = True) -> None:
        """Maxwell-Boltzmann velocities at ``temperature`` K, keyed by atom id (collective)."""
        if self._started:
            raise RuntimeError("Simulation.set_velocities: call it before run()")
        zero = self.integrator.momentum_conserved or exact
        self.md.velocities = maxwell_boltzmann(
            self.md.masses, self.md.ids, temperature, seed, reduce=self.md.reduce, zero_momentum=zero, exact=exact
        )

    def system(self) -> System:
        """The whole current system in the original atom order, on every rank (collective)."""
        return self.sharded.to_system()

    # ----------------------------------------------------------------- run
    def run(self, steps: int) -> Simulation:
        """Advance ``steps`` steps (fewer if a minimiser converged); collective.

        Reports as the reporters ask, checkpoints every ``checkpoint_every``
        steps and at the end, then lets the reporters finish (plot, newline).
        """
        if not (isinstance(steps, int) and steps >= 0):
            raise ValueError(f"Simulation.run: steps must be an integer >= 0, got {steps!r}")
        md = self.md
        self.timing = RunTiming(md.step, md.step + steps)
        if not self._started:
            self._start()
        self.timing.started = time.perf_counter()
        with scheduled_collection() as collect:  # no full garbage collection mid-run (see .collection)
            for _ in range(steps):
                if self.integrator.converged:
                    break
                n = md.step + 1
                self._step(n)
                collect(n)
        if self.checkpoint is not None and self._last_checkpoint != md.step:
            self.save_checkpoint()
        for r in self.reporters:
            r.finish(self)
        return self

    @contextlib.contextmanager
    def _naming_step(self, n: int):
        """Errors raised while computing step ``n`` name it, also on ranks that see another rank's failure a step later."""
        comm = self.sharded.comm
        comm.failure_label = f"MD step {n}: "  # heads this rank's failure report (see Comm.guard)
        try:
            yield
        except Exception as exc:
            _prefix_step(exc, n)
            raise
        finally:
            comm.failure_label = ""

    def _step(self, n: int) -> None:
        """Step ``n``: integrate, then report and checkpoint as asked."""
        md = self.md
        md.want_stress = self._wants_stress(n)
        md.want_energy = self._wants_energy(n)
        with self._naming_step(n):
            self.integrator.step(md)
        md.step, md.time = n, md.time + self.integrator.timestep
        self.timing.tick(n)
        self._report(n)
        if self.checkpoint is not None and self.checkpoint_every and n % self.checkpoint_every == 0:
            self.save_checkpoint()

    def _start(self) -> None:
        md = self.md
        md.want_stress = self._wants_stress(md.step) and not self.restarted
        with self._naming_step(md.step):
            md.compute()
        self.integrator.setup(md, self.restarted)
        for r in self.reporters:
            r.start(self)
        if not self.restarted:
            self._report(md.step)
        self._started = True

    @property
    def target_step(self) -> int:
        """The step the current :meth:`run` call ends at."""
        return self.timing.target_step if self.timing is not None else self.md.step

    def _wants_stress(self, step: int) -> bool:
        return any(r.wants_stress(step) for r in self.reporters)

    def _wants_energy(self, step: int) -> bool:
        """The energy is evaluated where a reporter or the integrator uses it, and at the end of each run.

        Other steps evaluate forces only (as LAMMPS evaluates energies on thermo
        steps only); the forces, and so the trajectory, are the same.
        """
        if self.integrator.energy_every_step or step == self.target_step:
            return True
        return any(r.wants_energy(step) for r in self.reporters)

    def _report(self, step: int) -> None:
        due = [r for r in self.reporters if r.due(step)]
        if not due:
            return
        thermo = self.thermo() if any(getattr(r, "needs_thermo", False) for r in due) else None
        for r in due:
            r.report(self, thermo)

    def thermo(self) -> dict:
        """Thermodynamic quantities of the current step (collective; the same on every rank).

        Keys: ``step``, ``time`` (fs), ``potential``, ``kinetic``, ``total``,
        ``conserved`` (eV), ``temperature`` (K), ``pressure`` (GPa; NaN when the
        stress was not evaluated at this step or the cell is not periodic),
        ``volume`` (Å³) and ``density`` (g/cm³; NaN unless periodic along all
        three axes).
        """
        md = self.md
        kinetic = float(md.kinetic_energy())
        potential = float(md.energy)
        dof = self.integrator.dof(md.n_total)
        volume = float(torch.linalg.det(self.sharded.cell.to(torch.float64)).abs()) if md.can_stress else math.nan
        mass = float(md.reduce(md.masses.sum().reshape(1).to(torch.float64))[0])
        pressure = math.nan
        if md.stress is not None and md.want_stress:
            pressure = (2.0 * kinetic / (3.0 * volume) - float(torch.trace(md.stress)) / 3.0) * EV_PER_A3_TO_GPA
        total = potential + kinetic
        return {
            "step": md.step,
            "time": md.time,
            "potential": potential,
            "kinetic": kinetic,
            "total": total,
            "conserved": total + self.integrator.extra_energy(md),
            "temperature": 2.0 * kinetic / (dof * KB) if dof else 0.0,
            "pressure": pressure,
            "volume": volume,
            "density": mass * AMU_PER_A3_TO_G_PER_CM3 / volume,
        }

    # --------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict:
        """Everything needed to continue, full arrays in original atom order (collective).

        The per-atom arrays are gathered to rank 0 only (``None`` on the other ranks).
        """
        sh, md = self.sharded, self.md

        def on_rank0(x: torch.Tensor) -> torch.Tensor | None:
            full = sh.gather(x, root=0)
            return None if full is None else full.cpu()

        fields = {k: on_rank0(v) for k, v in sh.fields.items()}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": md.step,
            "time": md.time,
            "n_atoms": sh.n_total,
            "positions": on_rank0(sh.positions),
            "velocities": fields.pop("velocities"),
            "numbers": on_rank0(sh.numbers),
            "masses": on_rank0(sh.masses),
            "cell": sh.cell.detach().cpu(),
            "pbc": sh.pbc.cpu(),
            "fields": fields,
            "integrator": {"type": type(self.integrator).__name__, "state": self.integrator.state_dict(md)},
            "timestep": self.integrator.timestep,
            "physics": self.fingerprint,
        }

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write a checkpoint atomically (collective; rank 0 writes)."""
        path = Path(path) if path is not None else self.checkpoint
        if path is None:
            raise ValueError("Simulation.save_checkpoint: no checkpoint path was configured; pass one")
        state = self.checkpoint_state()
        if self.rank == 0:
            atomic_save(state, path)
        self._last_checkpoint = self.md.step
        return path


def atomic_save(obj, path: str | Path) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def restart_changes(state: dict, pipeline: Pipeline, integrator: Integrator, system: System | None = None) -> list[str]:
    """How the physics of a restart differs from a loaded checkpoint's, one line per change (empty: none).

    Parameters
    ----------
    state : the checkpoint, as :func:`load_checkpoint` returns it.
    pipeline, integrator : what the restart would run with.
    system : the system the run is configured with; ``None``: not compared.
    """
    stored = state["physics"]
    models, groups = pipeline_fingerprint(pipeline)
    current = {
        "system": _identity(system) if system is not None else stored["system"],
        "models": models,
        "groups": groups,
        "integrator": integrator_fingerprint(integrator),
    }
    return fingerprint_changes(stored, current)


def _unreadable(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} {reason}; restore an intact copy or start a new run without --restart")


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :meth:`Simulation.save_checkpoint`.

    Raises
    ------
    FileNotFoundError : there is no file at ``path``.
    CheckpointError : the file is empty, truncated, corrupt, or not a halopipe
        MD checkpoint of this format; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; run without --restart first")
    if path.stat().st_size == 0:
        raise _unreadable(path, "is empty (0 bytes): the run that wrote it was interrupted before its first checkpoint")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as handle:
            zip_header = handle.read(4) == b"PK\x03\x04"
        raise _unreadable(path, "is truncated (incomplete archive)" if zip_header else "is not a halopipe checkpoint (not a torch archive)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and pickle raise many kinds; the file is unusable in every case
        raise _unreadable(path, "is corrupt, or holds objects (not plain data) and is not a halopipe checkpoint") from exc
    found = state.get("format") if isinstance(state, dict) else None
    if found != CHECKPOINT_FORMAT:
        what = f"has format {found!r}" if isinstance(found, str) else f"holds a {type(state).__name__} without a format tag"
        raise _unreadable(path, f"is not a halopipe MD checkpoint: it {what}, expected {CHECKPOINT_FORMAT!r}")
    return state


def checkpoint_system(state: dict, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> System:
    """The :class:`~halopipe.System` stored in a checkpoint (velocities included)."""
    fields = dict(state["fields"])
    fields["velocities"] = state["velocities"]
    system = System(
        positions=state["positions"], numbers=state["numbers"], cell=state["cell"], pbc=state["pbc"], masses=state["masses"], fields=fields
    )
    return system.to(dtype=dtype, device=device) if dtype is not None or device is not None else system
