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

_NAMES_BY_MODULE = {
    "halopipe.system": ["System"],
    "halopipe.models": [
        "Model",
        "ModelOutput",
        "LocalView",
        "NonFiniteError",
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
    ],
    "halopipe.pipeline": ["Pipeline", "Group", "Step"],
    "halopipe.domain": ["DomainConfig"],
    "halopipe.batch": ["Batch"],
    "halopipe.testing": ["check_model"],
    "halopipe.ase": ["Calculator"],
    "halopipe.distributed": ["ShardedSystem", "DistributedError"],
    "halopipe.distributed.launch": ["spawn", "SpawnError"],
    "halopipe.distributed.affinity": ["bind_local_rank"],
    "halopipe.allocator": ["keep_freed_memory"],
    "halopipe.dynamics": [
        "Simulation",
        "VelocityVerlet",
        "Langevin",
        "NoseHooverChain",
        "FIRE",
        "IsotropicMTKNPT",
        "MTKNPT",
        "StochasticCellRescaling",
        "AnisotropicCellRescaling",
        "load_checkpoint",
    ],
}
_EXPORTS = {name: module for module, names in _NAMES_BY_MODULE.items() for name in names}

# A literal list, so that static tools read it; tests/test_imports.py checks it names exactly the exports.
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
    "DFTD3Mesh",
    "Ewald",
    "PME",
    "MACE",
    "SevenNet",
    "TorchModel",
    "Pipeline",
    "Group",
    "Step",
    "DomainConfig",
    "Batch",
    "check_model",
    "Calculator",
    "ShardedSystem",
    "DistributedError",
    "spawn",
    "SpawnError",
    "bind_local_rank",
    "keep_freed_memory",
    "Simulation",
    "VelocityVerlet",
    "Langevin",
    "NoseHooverChain",
    "FIRE",
    "IsotropicMTKNPT",
    "MTKNPT",
    "StochasticCellRescaling",
    "AnisotropicCellRescaling",
    "load_checkpoint",
    "__version__",
]

if TYPE_CHECKING:  # static tools see the eager imports
    from .allocator import keep_freed_memory
    from .ase import Calculator
    from .batch import Batch
    from .distributed import DistributedError, ShardedSystem
    from .distributed.affinity import bind_local_rank
    from .distributed.launch import SpawnError, spawn
    from .domain import DomainConfig
    from .dynamics import (
        FIRE,
        MTKNPT,
        AnisotropicCellRescaling,
        IsotropicMTKNPT,
        Langevin,
        NoseHooverChain,
        Simulation,
        StochasticCellRescaling,
        VelocityVerlet,
        load_checkpoint,
    )
    from .models import (
        DFTD3,
        MACE,
        PME,
        ChargeModel,
        DFTD3Mesh,
        DSFCoulomb,
        Ewald,
        LennardJones,
        LocalView,
        Model,
        ModelOutput,
        NonFiniteError,
        SevenNet,
        TorchModel,
    )
    from .pipeline import Group, Pipeline, Step
    from .system import System
    from .testing import check_model


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'halopipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
