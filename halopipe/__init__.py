"""halopipe: composed interatomic potentials under spatial domain decomposition.

The public API in one place: systems, models, pipelines, the distributed layer
and the dynamics built on them. Names are imported on first use (PEP 562), so
``import halopipe`` (and the ``halopipe --help`` command line) does not pay for
importing torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "System": "halopipe.system",
    "Model": "halopipe.models",
    "ModelOutput": "halopipe.models",
    "LocalView": "halopipe.models",
    "LennardJones": "halopipe.models",
    "DSFCoulomb": "halopipe.models",
    "ChargeModel": "halopipe.models",
    "DFTD3": "halopipe.models",
    "Ewald": "halopipe.models",
    "PME": "halopipe.models",
    "MACE": "halopipe.models",
    "TorchModel": "halopipe.models",
    "NonFiniteError": "halopipe.models",
    "Pipeline": "halopipe.pipeline",
    "Group": "halopipe.pipeline",
    "Step": "halopipe.pipeline",
    "DomainConfig": "halopipe.domain",
    "ShardedSystem": "halopipe.distributed",
    "DistributedError": "halopipe.distributed",
}

__all__ = [
    "System",
    "Model",
    "ModelOutput",
    "LocalView",
    "NonFiniteError",
    "LennardJones",
    "DSFCoulomb",
    "ChargeModel",
    "DFTD3",
    "Ewald",
    "PME",
    "MACE",
    "TorchModel",
    "NonFiniteError",
    "Pipeline",
    "Group",
    "Step",
    "DomainConfig",
    "ShardedSystem",
    "DistributedError",
    "__version__",
]

if TYPE_CHECKING:  # static tools see the eager imports
    from .distributed import DistributedError, ShardedSystem
    from .domain import DomainConfig
    from .models import (
        DFTD3,
        MACE,
        PME,
        ChargeModel,
        DSFCoulomb,
        Ewald,
        LennardJones,
        LocalView,
        Model,
        ModelOutput,
        NonFiniteError,
        TorchModel,
    )
    from .pipeline import Group, Pipeline, Step
    from .system import System


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'halopipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
