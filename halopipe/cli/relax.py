"""``halopipe relax``: relax every frame of a structure file with FIRE, optionally with its cell.

The potential comes from a YAML file with the ``models:`` section of a ``halopipe run`` configuration (and
optionally ``groups:``, ``domain:``, ``precision:``, ``device:``), built by :mod:`halopipe.config`, so every
model type and every check of a run configuration applies. A full run configuration works too: its ``system``,
``integrator`` and ``steps`` are validated and ignored.

Each frame is relaxed by ASE's FIRE (:class:`ase.optimize.FIRE`, default parameters), ``batch`` frames at a time
through one :class:`halopipe.ase.BatchCalculator`: one batched pipeline call per FIRE iteration serves all of them,
and a frame leaves the batch when it converges (its place goes to the next frame). The atoms only, or with
``cell=True`` atoms and cell together through :class:`ase.filters.FrechetCellFilter` (the stress relaxed against
``pressure``). ASE's optimiser rather than halopipe's :class:`~halopipe.dynamics.FIRE`, because the latter moves
atoms only: one optimiser for both modes keeps ``fmax`` and the step counts meaning the same with and without the
cell, and ASE's filter conventions come with it. The force criterion is ASE's: the largest row norm of what the
optimiser moves (atomic forces; with the cell, also the filter's cell rows, the virial divided by the number of
atoms, so the stress is relaxed to about ``fmax * N / V``). Single process: ``--nproc`` would need ranks to agree
on every frame's failure, which the launch machinery does not give for free.

Before a frame is relaxed it is checked: no atoms, an element a model has no parameters for, a field no step
produces, atoms closer than :attr:`halopipe.System.min_distance` (0.5 Å), or ``cell=True`` on a cell that is not
periodic in three dimensions fail that frame with a message naming it; so does any error while it relaxes. The run
goes on with the next frame (or stops, ``stop_on_error``); relaxed frames are appended to the output as each one
finishes, so they survive a later failure or an interrupt.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import ConfigError, RunConfig
from ..pipeline import Pipeline

if TYPE_CHECKING:
    from ase import Atoms

__all__ = [
    "RelaxSettings",
    "Relaxed",
    "FrameError",
    "Potential",
    "load_potential",
    "check_frame",
    "relax_frames",
    "relax_file",
]

_IGNORED_SECTIONS = {"system": {"generator": "argon"}, "integrator": {"type": "fire"}, "steps": 0}
"""Sections a run configuration requires that relaxing does not use: placeholders, so a YAML may leave them out."""


class FrameError(ValueError):
    """A frame that could not be relaxed; the message names the frame."""


@dataclass(frozen=True)
class RelaxSettings:
    """How each frame is relaxed.

    Parameters
    ----------
    fmax : converged when the largest force row is below this, eV/Å.
    steps : most FIRE steps per frame.
    cell : relax the cell too (ASE's ``FrechetCellFilter``).
    pressure : external pressure for ``cell``, GPa.
    batch : frames relaxed together, one batched pipeline call per FIRE iteration for all of them.
    """

    fmax: float = 0.05
    steps: int = 500
    cell: bool = False
    pressure: float = 0.0
    batch: int = 64


@dataclass
class Relaxed:
    """What became of one frame: the relaxed atoms (with a ``SinglePointCalculator``) or the error.

    ``fmax`` is the optimiser's final criterion value (with the cell, the filter's cell rows count) and
    ``energy`` the potential energy, eV (under a pressure, not the enthalpy).
    """

    index: int
    n_atoms: int
    atoms: Atoms | None = None
    converged: bool = False
    steps: int = 0
    fmax: float = float("nan")
    energy: float = float("nan")
    error: str | None = None


@dataclass
class Potential:
    """The configured pipeline, its models by name (for the species check) and the configuration they came from."""

    config: RunConfig
    models: dict
    pipeline: Pipeline


def load_potential(path: str | Path) -> Potential:
    """Build the potential of ``path`` (a YAML with ``models:`` at least); every section is validated here."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError("<file>", f"potential file {str(path)!r} does not exist; pass a YAML with a models: section (see examples/)")
    try:
        data = yaml.safe_load(path.read_text())
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError("<file>", f"{path} is not a YAML text file ({type(exc).__name__}); pass a YAML with a models: section") from None
    if not isinstance(data, dict) or "models" not in data:
        raise ConfigError("models", f"{path} has no models: section; give the models (and optionally groups:) as in examples/*.yaml")
    config = RunConfig({**_IGNORED_SECTIONS, **data}, source=str(path), base=path.parent)
    models = config.build_models()
    return Potential(config, models, config.build_pipeline(models))


def check_frame(atoms: Atoms, index: int, potential: Potential, cell: bool) -> None:
    """Raise :class:`FrameError` naming frame ``index`` if it cannot be relaxed with ``potential``."""
    from ..system import System

    config = potential.config
    if len(atoms) == 0:
        raise FrameError(f"frame {index} has no atoms; remove it from the file")
    if cell and not atoms.pbc.all():
        raise FrameError(
            f"frame {index}: --cell needs a cell periodic in 3 dimensions, got pbc={atoms.pbc.tolist()}; relax it without --cell"
        )
    try:
        system = System.from_ase(atoms, dtype=config.dtype)
        config.check_species(system, potential.models)
        config.check_fields(system, potential.pipeline)
        system.check_close_contacts()
    except ConfigError as exc:
        raise FrameError(f"frame {index}: {exc.key} in {config.source}: {exc.message}") from exc
    except ValueError as exc:
        raise FrameError(f"frame {index}: {exc}") from exc


class _Relaxing:
    """One frame under relaxation: its atoms (served by the batch), the optimised object and ASE's FIRE on it."""

    def __init__(self, index: int, atoms: Atoms, settings: RelaxSettings) -> None:
        from ase import units
        from ase.filters import FrechetCellFilter
        from ase.optimize import FIRE

        self.outcome = Relaxed(index, len(atoms))
        self.atoms, self.settings = atoms, settings
        self.target = FrechetCellFilter(atoms, scalar_pressure=settings.pressure * units.GPa) if settings.cell else atoms
        self.optimizer = FIRE(self.target, logfile=None)

    def check(self) -> bool:
        """The force criterion on the current atoms (evaluated in the batch's call); True when this frame is done."""
        forces = self.target.get_forces()
        self.outcome.fmax = float(np.sqrt((forces**2).sum(axis=1).max()))
        self.outcome.converged = self.outcome.fmax < self.settings.fmax
        return self.outcome.converged or self.outcome.steps >= self.settings.steps

    def step(self) -> None:
        """One FIRE step (its forces are the ones :meth:`check` read: no new evaluation)."""
        self.optimizer.step()
        self.outcome.steps += 1

    def finished(self) -> Relaxed:
        """The outcome, its atoms holding a ``SinglePointCalculator`` with energy, forces (and stress with the cell)."""
        from ase.calculators.singlepoint import SinglePointCalculator

        results = {"energy": self.atoms.get_potential_energy(), "forces": self.atoms.get_forces()}
        if self.settings.cell:
            results["stress"] = self.atoms.get_stress()
        self.outcome.energy = float(results["energy"])
        self.atoms.calc = SinglePointCalculator(self.atoms, **results)
        self.outcome.atoms = self.atoms
        return self.outcome

    def failed(self, exc: Exception) -> Relaxed:
        what = str(exc) if isinstance(exc, (ValueError, OSError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
        self.outcome.error = f"frame {self.outcome.index}: {what}"
        return self.outcome


def relax_frames(frames: Iterable, potential: Potential, settings: RelaxSettings, stop_on_error: bool = False) -> Iterator[Relaxed]:
    """Relax ``frames`` together, ``settings.batch`` at a time, yielding each outcome as its frame finishes.

    Every FIRE iteration makes one batched pipeline call for all frames in the batch
    (:class:`halopipe.ase.BatchCalculator`): first every frame reads its forces (the first read evaluates them all)
    and leaves the batch when converged or out of steps, then every remaining frame takes its FIRE step; a free
    place is filled with the next frame. Each frame's optimiser is ASE's FIRE, so its path is the one a loop of
    ASE runs would take. A frame that fails its check or raises while relaxing yields its error; the others go on,
    or, with ``stop_on_error``, only the earlier frames still relaxing finish (as a loop would have relaxed them
    before reaching the failure) and no later frame starts.
    """
    from ..ase import BatchCalculator

    if settings.batch < 1:
        raise ValueError(f"RelaxSettings.batch must be a positive number of frames, got {settings.batch!r}")
    config = potential.config
    batch = BatchCalculator(potential.pipeline, dtype=config.dtype, device=config.device, stress=settings.cell)
    waiting = iter(enumerate(frames))
    active: list[_Relaxing] = []
    stop_at: int | None = None  # with stop_on_error: the first failed frame; later ones do not run
    while active or stop_at is None:
        admitted = _admit(waiting, settings.batch - len(active), potential, settings)
        for item in admitted:
            if isinstance(item, Relaxed):  # failed its check
                yield item
                if stop_on_error:
                    stop_at = item.index if stop_at is None else min(stop_at, item.index)
                    break
            else:
                batch.attach([item.atoms])
                active.append(item)
        if not admitted and not active:
            break
        stepping = []
        for frame in active:
            try:
                done = frame.check()
                outcome = frame.finished() if done else None
            except Exception as exc:  # any failure of one frame (a model's error, non-finite forces) must not end the others
                done, outcome = True, frame.failed(exc)
            if done:
                batch.detach(frame.atoms)
                yield outcome
                if outcome.error is not None and stop_on_error:
                    stop_at = outcome.index if stop_at is None else min(stop_at, outcome.index)
            else:
                stepping.append(frame)
        if stop_at is not None:  # a loop would not have started the frames after the failure
            for frame in [f for f in stepping if f.outcome.index > stop_at]:
                batch.detach(frame.atoms)
            stepping = [f for f in stepping if f.outcome.index < stop_at]
        for frame in stepping:
            frame.step()
        active = stepping


def _admit(waiting: Iterator, places: int, potential: Potential, settings: RelaxSettings) -> list:
    """Up to ``places`` next frames: a :class:`_Relaxing` for each that passes its check, the failed
    :class:`Relaxed` for each that does not (failures do not take a place)."""
    admitted: list = []
    while places > 0:
        item = next(waiting, None)
        if item is None:
            break
        index, atoms = item
        try:
            check_frame(atoms, index, potential, settings.cell)
        except FrameError as exc:
            admitted.append(Relaxed(index, len(atoms), error=str(exc)))
            continue
        admitted.append(_Relaxing(index, atoms.copy(), settings))
        places -= 1
    return admitted


def _read_frames(path: Path) -> list:
    import ase.io

    if not path.is_file():
        raise FileNotFoundError(f"structure file {str(path)!r} does not exist")
    try:
        return ase.io.read(path, index=":")
    except Exception as exc:  # ASE raises many kinds
        raise ValueError(f"ASE could not read {path}: {type(exc).__name__}: {exc}; check the file and its format") from exc


def _write(outcome: Relaxed, output: Path) -> None:
    import ase.io

    atoms = outcome.atoms
    atoms.info.update(frame=outcome.index, converged=outcome.converged, relax_steps=outcome.steps, fmax=outcome.fmax)
    ase.io.write(output, atoms, format="extxyz", append=True)


class _InOrder:
    """Appends relaxed frames to the output in input order: a frame waits until every earlier one is done."""

    def __init__(self, output: Path) -> None:
        self.output, self.done, self.next = output, {}, 0

    def add(self, outcome: Relaxed) -> None:
        self.done[outcome.index] = outcome
        while self.next in self.done:
            self._write(self.done.pop(self.next))
            self.next += 1

    def flush(self) -> None:
        for index in sorted(self.done):
            self._write(self.done.pop(index))

    def _write(self, outcome: Relaxed) -> None:
        if outcome.error is None:
            _write(outcome, self.output)


def summary_table(outcomes: list[Relaxed]) -> str:
    """The table printed at the end: one row per frame."""
    lines = [f"{'frame':>5}  {'atoms':>6}  {'converged':>9}  {'steps':>5}  {'fmax_eV/A':>10}  {'energy_eV':>16}"]
    for o in outcomes:
        if o.error is not None:
            lines.append(f"{o.index:>5}  {o.n_atoms:>6}  {'failed':>9}  {'-':>5}  {'-':>10}  {'-':>16}")
        else:
            state = "yes" if o.converged else "no"
            lines.append(f"{o.index:>5}  {o.n_atoms:>6}  {state:>9}  {o.steps:>5}  {o.fmax:>10.4g}  {o.energy:>16.8f}")
    return "\n".join(lines)


def relax_file(structures: str | Path, output: str | Path, config: str | Path, settings: RelaxSettings, stop_on_error: bool = False) -> int:
    """``halopipe relax``: relax every frame of ``structures`` into ``output`` (extended XYZ) with the potential
    of the YAML file ``config``; returns the exit status.

    Returns 1 if a frame failed (its error printed to stderr when it happens, the others relaxed), else 0. With
    ``stop_on_error`` the first failure raises :class:`FrameError` after the summary of the frames so far.
    """
    from tqdm import tqdm

    from .report import note, warn

    structures, output = Path(structures), Path(output)
    if output.resolve() == structures.resolve():
        raise ValueError(f"the output {output} is the input file; pass another -o so the input is kept")
    potential = load_potential(config)
    note(f"reading {structures}")
    frames = _read_frames(structures)
    output.write_text("")  # relaxed frames are appended in input order as soon as every earlier frame is done
    outcomes: list[Relaxed] = []
    writer = _InOrder(output)
    with tqdm(total=len(frames), file=sys.stderr, unit="frame", dynamic_ncols=True, desc="relax") as bar:
        for outcome in relax_frames(frames, potential, settings, stop_on_error=stop_on_error):
            outcomes.append(outcome)
            writer.add(outcome)
            if outcome.error is not None and not stop_on_error:
                bar.write(f"halopipe relax: error: {outcome.error}", file=sys.stderr)
            bar.update()
    writer.flush()
    outcomes.sort(key=lambda o: o.index)
    print(summary_table(outcomes))
    if stop_on_error and any(o.error is not None for o in outcomes):
        raise FrameError(next(o.error for o in outcomes if o.error is not None))
    failed = [o.index for o in outcomes if o.error is not None]
    unconverged = [o.index for o in outcomes if o.error is None and not o.converged]
    if unconverged:
        warn(
            "halopipe relax",
            f"frame(s) {_listed(unconverged)} did not reach fmax {settings.fmax:g} eV/Å in {settings.steps} steps; raise --steps",
        )
    relaxed = len(outcomes) - len(failed)
    if failed:
        print(
            f"halopipe relax: frame(s) {_listed(failed)} failed (errors above); the other {relaxed} frame(s) are in {output}",
            file=sys.stderr,
        )
        return 1
    note(f"{relaxed} frame(s) written to {output}")
    return 0


def _listed(indices: list[int]) -> str:
    return ", ".join(map(str, indices))
