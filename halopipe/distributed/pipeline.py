"""How a :class:`~halopipe.Pipeline` called on a plain System runs across ranks.

The core pipeline knows only the :class:`~halopipe.domain.Domain` interface
(it must not import this package). On import, this package registers
:func:`scatter_for_pipeline` with :func:`halopipe.pipeline.register_decomposition`:
under a process group of more than one rank, ``pipeline(system)`` then
scatters the system with the pipeline's own :class:`~halopipe.DomainConfig`
and evaluates it decomposed, and the user's single-process script runs
unchanged under ``torchrun`` or ``srun`` (the ranks join their process group
at the first call when the script did not). Callers who keep the decomposition between
calls (molecular dynamics) scatter once and call the pipeline on the
:class:`~halopipe.distributed.ShardedSystem`.
"""

from __future__ import annotations

import torch.distributed as dist

from ..domain import DomainConfig
from ..system import System
from .launch import init_from_environment, launched_by_runner
from .sharded import ShardedSystem

__all__ = ["scatter_for_pipeline"]


def scatter_for_pipeline(system: System | None, config: DomainConfig) -> ShardedSystem | None:
    """Rank 0's ``system`` split over the running process group, or ``None`` when there is at most one rank.

    Collective. Ranks other than 0 may pass the system too (their copy is
    ignored: rank 0's is the one scattered) or ``None``. Under a launcher
    whose process group the script has not joined, this joins it.
    """
    if launched_by_runner() and not (dist.is_available() and dist.is_initialized()):
        init_from_environment(timeout=config.timeout)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return ShardedSystem.scatter(system if dist.get_rank() == 0 else None, config)
