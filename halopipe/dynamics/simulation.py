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

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import ShardedSystem
from ..models.base import Model
from ..pipeline import Pipeline
from ..system import System
from .integrators import Integrator, MDState
from .units import EV_PER_A3_TO_GPA, KB
from .velocities import maxwell_boltzmann

__all__ = ["Simulation", "atomic_save", "load_checkpoint", "checkpoint_system", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "halopipe-md-checkpoint/1"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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
        self.restarted = False
        self._started = False
        self._last_checkpoint = -1

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
    ) -> Simulation:
        """Continue from the checkpoint at ``path`` (on any number of ranks).

        The run then continues exactly as if uninterrupted: positions,
        velocities, the step, and the integrator's state (thermostat
        variables, the noise counter) come from the checkpoint.
        """
        state = load_checkpoint(path) if _rank() == 0 else None
        system = checkpoint_system(state, device=device) if state is not None else None
        sim = cls(model, system, integrator, reporters, checkpoint if checkpoint is not None else path, checkpoint_every)
        head = None
        if state is not None:
            head = {"step": state["step"], "time": state["time"], "integrator": state["integrator"]}
        head = sim.sharded.comm.broadcast_object(head, src=0)
        kind = head["integrator"]["type"]
        if kind != type(integrator).__name__:
            raise ValueError(
                f"Simulation.restart: {path} was written by a {kind} run but this run uses {type(integrator).__name__}; "
                "a restart continues the same run (start a new run from the checkpoint's structure instead)"
            )
        sim.md.step, sim.md.time = int(head["step"]), float(head["time"])
        integrator.load_state_dict(head["integrator"]["state"], sim.md)
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
        self._target = md.step + steps
        if not self._started:
            self._start()
        for _ in range(steps):
            if self.integrator.converged:
                break
            n = md.step + 1
            md.want_stress = self._wants_stress(n)
            self.integrator.step(md)
            md.step, md.time = n, md.time + self.integrator.timestep
            self._report(n)
            if self.checkpoint is not None and self.checkpoint_every and n % self.checkpoint_every == 0:
                self.save_checkpoint()
        if self.checkpoint is not None and self._last_checkpoint != md.step:
            self.save_checkpoint()
        for r in self.reporters:
            r.finish(self)
        return self

    def _start(self) -> None:
        md = self.md
        md.want_stress = self._wants_stress(md.step) and not self.restarted
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
        return getattr(self, "_target", self.md.step)

    def _wants_stress(self, step: int) -> bool:
        return any(r.wants_stress(step) for r in self.reporters)

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
        stress was not evaluated at this step or the cell is not periodic).
        """
        md = self.md
        kinetic = float(md.kinetic_energy())
        potential = float(md.energy)
        dof = self.integrator.dof(md.n_total)
        pressure = math.nan
        if md.stress is not None and md.want_stress:
            volume = float(torch.linalg.det(self.sharded.cell.to(torch.float64)).abs())
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
        }

    # --------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict:
        """Everything needed to continue, full arrays in original atom order (collective)."""
        sh, md = self.sharded, self.md
        fields = {k: sh.gather(v).cpu() for k, v in sh.fields.items()}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": md.step,
            "time": md.time,
            "n_atoms": sh.n_total,
            "positions": sh.gather(sh.positions).cpu(),
            "velocities": fields.pop("velocities"),
            "numbers": sh.gather(sh.numbers).cpu(),
            "masses": sh.gather(sh.masses).cpu(),
            "cell": sh.cell.detach().cpu(),
            "pbc": sh.pbc.cpu(),
            "fields": fields,
            "integrator": {"type": type(self.integrator).__name__, "state": self.integrator.state_dict(md)},
            "timestep": self.integrator.timestep,
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


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by :meth:`Simulation.save_checkpoint`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; run without --restart first")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a halopipe MD checkpoint (format {CHECKPOINT_FORMAT})")
    return state


def checkpoint_system(state: dict, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> System:
    """The :class:`~halopipe.System` stored in a checkpoint (velocities included)."""
    fields = dict(state["fields"])
    fields["velocities"] = state["velocities"]
    system = System(
        positions=state["positions"], numbers=state["numbers"], cell=state["cell"], pbc=state["pbc"], masses=state["masses"], fields=fields
    )
    return system.to(dtype=dtype, device=device) if dtype is not None or device is not None else system
