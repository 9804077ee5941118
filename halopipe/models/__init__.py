"""Interatomic models. Each file holds one model family: physics only."""

from .adapter import TorchModel
from .base import LocalView, Model, ModelOutput, NonFiniteError, add_to_owned, fold_ghost_shares, pair_energies_once, virial_from_forces
from .charges import ChargeModel
from .coulomb import DSFCoulomb
from .dftd3 import DFTD3
from .dftd3_mesh import DFTD3Mesh
from .ewald import Ewald
from .lennard_jones import LennardJones
from .mace import MACE
from .pme import PME
from .sevennet import SevenNet

__all__ = [
    "LocalView",
    "Model",
    "ModelOutput",
    "NonFiniteError",
    "virial_from_forces",
    "fold_ghost_shares",
    "pair_energies_once",
    "add_to_owned",
    "LennardJones",
    "DSFCoulomb",
    "ChargeModel",
    "DFTD3",
    "DFTD3Mesh",
    "Ewald",
    "PME",
    "MACE",
    "SevenNet",
    "TorchModel",
]
