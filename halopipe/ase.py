"""An ASE calculator around a halopipe model or pipeline."""

from __future__ import annotations

import torch
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import all_changes

from .pipeline import Pipeline
from .system import System

__all__ = ["Calculator"]


class Calculator(_AseCalculator):
    """ASE calculator: energy, free_energy, forces and stress.

    Parameters
    ----------
    pipeline : a :class:`~halopipe.Pipeline` (or a single model, wrapped).
    dtype, device : precision and device of the evaluation.
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress", "energies"]

    def __init__(self, pipeline, dtype: torch.dtype = torch.float64, device: str = "cpu", **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline if isinstance(pipeline, Pipeline) else Pipeline([pipeline])
        self.dtype, self.device = dtype, device

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        system = System.from_ase(self.atoms, dtype=self.dtype, device=self.device)
        want_stress = "stress" in properties and bool(self.atoms.pbc.all())
        out = self.pipeline(system, stress=want_stress)
        energy = float(out["energy"])
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": out["forces"].detach().cpu().double().numpy(),
            "energies": {k: float(v) for k, v in out["energies"].items()},
        }
        if want_stress:
            s = out["stress"].detach().cpu().double().numpy()
            self.results["stress"] = s[[0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]]
