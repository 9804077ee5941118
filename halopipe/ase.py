"""An ASE calculator around a halopipe model or pipeline, with ASE's conventions.

``energy``/``free_energy`` (eV), ``energies`` (per atom, eV, as
``atoms.get_potential_energies()`` promises), ``forces`` (eV/Å), ``stress``
(Voigt, eV/Å³, when the cell spans three dimensions, as ASE's Lennard-Jones
does) and ``charges`` (``atoms.get_charges()``) when the pipeline produces a
field named ``charges``. One extra property, ``model_energies``, maps each
step's name to its energy, and ``field_gradients=["charges"]`` adds
``d_energy_d_charges`` (per atom, see :class:`~halopipe.Pipeline`);
``export_properties`` leaves these out because ASE's output registry
(``ase.outputs``) does not know them.

The calculator keeps one pipeline; a change of atom count, species or cell
only makes the pipeline build a new plan, so ``atoms.calc`` stays usable.
Under a process group of several ranks (every rank running the same script),
the pipeline splits each evaluation over the ranks by itself.

:class:`BatchCalculator` serves many ``Atoms`` objects (the images of a NEB,
structures relaxed together) from one batched pipeline call: each gets a
calculator of its own, and the first one asked for a result evaluates every
attached structure that changed since its last evaluation, in one call
(:mod:`halopipe.batch`); the others are then answered from that call.
"""

from __future__ import annotations

import numpy as np
import torch
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import all_changes
from ase.outputs import Properties, all_outputs
from ase.stress import full_3x3_to_voigt_6_stress

from .batch import Batch
from .pipeline import Pipeline, gradient_key
from .system import System

__all__ = ["Calculator", "BatchCalculator"]


class Calculator(_AseCalculator):
    """ASE calculator for a :class:`~halopipe.Pipeline` (or a single model, wrapped).

    Parameters
    ----------
    pipeline : a :class:`~halopipe.Pipeline` or a :class:`~halopipe.Model`.
    dtype, device : precision and device of the evaluation.
    field_gradients : names of per-atom fields whose energy gradients to
        add as the properties ``d_energy_d_<name>`` (default: none).
    **kwargs : passed to :class:`ase.calculators.calculator.Calculator`.
    """

    def __init__(self, pipeline, dtype: torch.dtype = torch.float64, device: str = "cpu", field_gradients=(), **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline if isinstance(pipeline, Pipeline) else Pipeline([pipeline])
        self.dtype, self.device = dtype, device
        self.field_gradients = (field_gradients,) if isinstance(field_gradients, str) else tuple(field_gradients)
        produced = {name for group in self.pipeline.groups for step in group.steps for name in step.produced().values()}
        self.implemented_properties = ["energy", "free_energy", "energies", "forces", "stress", "model_energies"]
        if "charges" in produced:
            self.implemented_properties.append("charges")
        self.implemented_properties += [gradient_key(name) for name in self.field_gradients]

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        system = System.from_ase(self.atoms, dtype=self.dtype, device=self.device)
        want_stress = "stress" in properties and _spans_space(self.atoms)
        out = self.pipeline(system, stress=want_stress, field_gradients=self.field_gradients)
        self.results = _ase_results(out, self.field_gradients, want_stress)

    def export_properties(self) -> Properties:
        """ASE's checked property container, holding the properties ASE knows (all but ``model_energies``)."""
        return Properties({name: value for name, value in self.results.items() if name in all_outputs})


def _spans_space(atoms) -> bool:
    """Whether ``atoms``' cell spans three dimensions (stress defined); a Python bool (a numpy one would reach torch as requires_grad)."""
    return bool(atoms.cell.rank == 3)


def _ase_results(out: dict, field_gradients: tuple[str, ...], stress: bool) -> dict:
    """One system's pipeline result as an ASE calculator's ``results``."""
    energy = float(out["energy"])
    results = {
        "energy": energy,
        "free_energy": energy,
        "energies": _numpy(out["energies"]),
        "forces": _numpy(out["forces"]),
        "model_energies": {name: float(value) for name, value in out["model_energies"].items()},
    }
    results.update({gradient_key(name): _numpy(out[gradient_key(name)]) for name in field_gradients})
    if "charges" in out["fields"]:
        results["charges"] = _numpy(out["fields"]["charges"])
    if stress:
        results["stress"] = full_3x3_to_voigt_6_stress(_numpy(out["stress"]))
    return results


class BatchCalculator:
    """Many ``Atoms`` evaluated by one batched call of a :class:`~halopipe.Pipeline` (NEB images, structures relaxed together).

    :meth:`attach` gives each structure a calculator of its own
    (``atoms.calc``). When one of them is asked for a result it lacks, every
    attached structure that changed since its last evaluation (or lacks a
    result) is evaluated in one call, ``pipeline([s1, s2, ...])``; the
    others are then served from it. A structure stepped by an optimiser
    after the others were served is evaluated with the next group.

    Parameters
    ----------
    pipeline : a :class:`~halopipe.Pipeline` or a :class:`~halopipe.Model`.
    dtype, device : precision and device of the evaluation.
    stress : compute the stress of every structure whose cell spans three
        dimensions at every evaluation (a cell relaxation asks for forces and
        stress in turn: one call serves both); otherwise only when asked.

    Attributes
    ----------
    calls : batched pipeline calls made so far.
    """

    def __init__(self, pipeline, dtype: torch.dtype = torch.float64, device: str = "cpu", stress: bool = False) -> None:
        self.pipeline = pipeline if isinstance(pipeline, Pipeline) else Pipeline([pipeline])
        self.dtype, self.device, self.stress = dtype, device, bool(stress)
        self._served: list[tuple[object, _Served]] = []
        self.calls = 0

    def attach(self, images) -> None:
        """Give each of ``images`` (``Atoms``) a calculator served by this batch."""
        for atoms in images:
            atoms.calc = _Served(self)
            self._served.append((atoms, atoms.calc))

    def detach(self, atoms) -> None:
        """Stop serving ``atoms`` (a converged structure leaves the batch); its last results stay on its calculator."""
        self._served = [(a, c) for a, c in self._served if a is not atoms]

    def _serve(self, properties) -> None:
        """Evaluate, in one call per kind (with stress, without), every attached structure that needs it."""
        wanted = set(properties) | ({"stress"} if self.stress else set())
        stale = [(a, c) for a, c in self._served if c.needs(a, properties)]
        for atoms, calc in stale:
            calc.atoms, calc.results, calc.error = atoms.copy(), {}, None
        with_stress = [(a, c) for a, c in stale if "stress" in wanted and _spans_space(a)]
        without = [(a, c) for a, c in stale if not ("stress" in wanted and _spans_space(a))]
        for group, stress in ((with_stress, True), (without, False)):
            if group:
                self._evaluate(group, stress)

    def _evaluate(self, group: list, stress: bool) -> None:
        """One batched call for ``group``; if it fails, each structure alone, so only the culprits keep an error."""
        systems = [System.from_ase(calc.atoms, dtype=self.dtype, device=self.device) for _, calc in group]
        self.calls += 1
        try:
            outs = Batch(systems).split(self.pipeline(systems, stress=stress))
        except Exception:
            if len(group) == 1:
                raise
            for member in group:
                try:
                    self._evaluate([member], stress)
                except Exception as exc:  # kept for the structure's own request
                    member[1].error = exc
            return
        for (_, calc), out in zip(group, outs):
            calc.results = _ase_results(out, (), stress)


class _Served(_AseCalculator):
    """The calculator of one structure of a :class:`BatchCalculator`."""

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress", "model_energies", "charges"]

    def __init__(self, batch: BatchCalculator) -> None:
        super().__init__()
        self.batch, self.error = batch, None

    def needs(self, atoms, properties) -> bool:
        """Whether ``atoms`` changed since this calculator's last evaluation, or it lacks one of ``properties``."""
        missing = [p for p in properties if p not in self.results and not (p == "stress" and not _spans_space(atoms))]
        return self.atoms is None or bool(self.check_state(atoms)) or bool(missing)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        self.batch._serve(properties)
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().to(torch.float64).numpy()
