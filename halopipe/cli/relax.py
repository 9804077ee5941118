"""``halopipe relax``: relax every frame of a structure file with FIRE, optionally with its cell.

The potential comes from a YAML file with the ``models:`` section of a ``halopipe run`` configuration (and
optionally ``groups:``, ``domain:``, ``precision:``, ``device:``), built by :mod:`halopipe.config`, so every
model type and every check of a run configuration applies. A full run configuration works too: its ``system``,
``integrator`` and ``steps`` are validated and ignored.

Each frame is relaxed by ASE's FIRE (:class:`ase.optimize.FIRE`, default parameters) through
:class:`halopipe.ase.Calculator`: the atoms only, or with ``cell=True`` atoms and cell together through
:class:`ase.filters.FrechetCellFilter` (the stress relaxed against ``pressure``). ASE's optimiser rather than
halopipe's :class:`~halopipe.dynamics.FIRE`, because the latter moves atoms only: one optimiser for both modes
keeps ``fmax`` and the step counts meaning the same with and without the cell, and ASE's filter conventions come
with it. The force criterion is ASE's: the largest row norm of what the optimiser moves (atomic forces; with the
cell, also the filter's cell rows, the virial divided by the number of atoms, so the stress is relaxed to about
``fmax * N / V``). Single process: ``--nproc`` would need ranks to agree on every frame's failure, which the
launch machinery does not give for free.

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
    "relax_structure",
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
    """

    fmax: float = 0.05
    steps: int = 500
    cell: bool = False
    pressure: float = 0.0


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


def relax_structure(atoms: Atoms, calculator, settings: RelaxSettings) -> tuple[Atoms, bool, int, float]:
    """Relax one structure with FIRE; returns the relaxed atoms (a ``SinglePointCalculator`` holding energy,
    forces and, with the cell, stress), whether it converged, the steps taken and the final largest force row."""
    from ase import units
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.filters import FrechetCellFilter
    from ase.optimize import FIRE

    atoms = atoms.copy()
    atoms.calc = calculator
    target = FrechetCellFilter(atoms, scalar_pressure=settings.pressure * units.GPa) if settings.cell else atoms
    optimizer = FIRE(target, logfile=None)
    converged = bool(optimizer.run(fmax=settings.fmax, steps=settings.steps))
    fmax = float(np.sqrt((target.get_forces() ** 2).sum(axis=1).max()))
    results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if settings.cell:
        results["stress"] = atoms.get_stress()
    atoms.calc = SinglePointCalculator(atoms, **results)
    return atoms, converged, optimizer.nsteps, fmax


def relax_frames(frames: Iterable, potential: Potential, settings: RelaxSettings) -> Iterator[Relaxed]:
    """Relax ``frames`` one after the other, yielding each outcome as it finishes (a failure as ``Relaxed.error``).

    This is the per-structure loop and the one place that evaluates the potential: a batched relaxation (many
    structures per pipeline call) replaces this function, yielding the same records as its structures finish.
    """
    from ..ase import Calculator

    config = potential.config
    calculator = Calculator(potential.pipeline, dtype=config.dtype, device=config.device)
    for index, atoms in enumerate(frames):
        outcome = Relaxed(index, len(atoms))
        try:
            check_frame(atoms, index, potential, settings.cell)
            outcome.atoms, outcome.converged, outcome.steps, outcome.fmax = relax_structure(atoms, calculator, settings)
            outcome.energy = float(outcome.atoms.get_potential_energy())
        except FrameError as exc:
            outcome.error = str(exc)
        except Exception as exc:  # any failure of one frame (a model's error, non-finite forces) must not end the others
            what = str(exc) if isinstance(exc, (ValueError, OSError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
            outcome.error = f"frame {index}: {what}"
        yield outcome


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
    output.write_text("")  # relaxed frames are appended one by one
    outcomes: list[Relaxed] = []
    with tqdm(total=len(frames), file=sys.stderr, unit="frame", dynamic_ncols=True, desc="relax") as bar:
        for outcome in relax_frames(frames, potential, settings):
            outcomes.append(outcome)
            if outcome.error is None:
                _write(outcome, output)
            elif stop_on_error:
                bar.close()
                print(summary_table(outcomes))
                raise FrameError(outcome.error)
            else:
                bar.write(f"halopipe relax: error: {outcome.error}", file=sys.stderr)
            bar.update()
    print(summary_table(outcomes))
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
