"""halopipe: composed interatomic potentials under spatial domain decomposition.

The public API in one place: systems, models, pipelines, the distributed layer
and the dynamics built on them.
"""

from .models import ChargeModel, DSFCoulomb, LennardJones, LocalView, Model, ModelOutput
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
    "Pipeline",
    "Group",
    "Step",
    "__version__",
]
