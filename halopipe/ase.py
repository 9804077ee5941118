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
"""

from __future__ import annotations

import numpy as np
import torch
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import all_changes
from ase.outputs import Properties, all_outputs
from ase.stress import full_3x3_to_voigt_6_stress

from .pipeline import Pipeline, gradient_key
from .system import System

__all__ = ["Calculator"]


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
        want_stress = "stress" in properties and bool(self.atoms.cell.rank == 3)  # a numpy bool would reach torch as requires_grad
        out = self.pipeline(system, stress=want_stress, field_gradients=self.field_gradients)
        energy = float(out["energy"])
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "energies": _numpy(out["energies"]),
            "forces": _numpy(out["forces"]),
            "model_energies": {name: float(value) for name, value in out["model_energies"].items()},
        }
        self.results.update({gradient_key(name): _numpy(out[gradient_key(name)]) for name in self.field_gradients})
        if "charges" in out["fields"]:
            self.results["charges"] = _numpy(out["fields"]["charges"])
        if want_stress:
            self.results["stress"] = full_3x3_to_voigt_6_stress(_numpy(out["stress"]))

    def export_properties(self) -> Properties:
        """ASE's checked property container, holding the properties ASE knows (all but ``model_energies``)."""
        return Properties({name: value for name, value in self.results.items() if name in all_outputs})


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().to(torch.float64).numpy()
