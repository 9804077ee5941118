"""halopipe: composed interatomic potentials under spatial domain decomposition.

The public API in one place: systems, models, pipelines, the distributed layer
and the dynamics built on them.
"""

from .distributed import DistributedError, DistributedModel, DistributedPipeline, DomainConfig, ShardedSystem
from .models import DFTD3, MACE, PME, ChargeModel, DSFCoulomb, Ewald, LennardJones, LocalView, Model, ModelOutput, SevenNet, TorchModel
from .pipeline import Group, Pipeline, Step
from .system import System

__version__ = "0.1.0"

__all__ = [
    "System",
    "Model",
    "ModelOutput",
    "LocalView",
    "LennardJones",
    "DSFCoulomb",
    "ChargeModel",
    "DFTD3",
    "Ewald",
    "PME",
    "MACE",
    "SevenNet",
    "TorchModel",
    "Pipeline",
    "Group",
    "Step",
    "DomainConfig",
    "ShardedSystem",
    "DistributedPipeline",
    "DistributedModel",
    "DistributedError",
    "__version__",
]
