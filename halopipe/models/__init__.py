"""Interatomic models. Each file holds one model family: physics only."""

from .base import LocalView, Model, ModelOutput, virial_from_forces
from .charges import ChargeModel
from .coulomb import DSFCoulomb
from .lennard_jones import LennardJones

__all__ = ["LocalView", "Model", "ModelOutput", "virial_from_forces", "LennardJones", "DSFCoulomb", "ChargeModel"]
