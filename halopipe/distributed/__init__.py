"""Domain decomposition on top of the core: communication, sharded systems and launching.

Geometry (bricks, images near bricks) lives in :mod:`halopipe.geometry` and the
evaluation in :mod:`halopipe.pipeline`; this package adds the halo exchange
(:mod:`.halo`, :mod:`.comm`), the :class:`ShardedSystem` domain and process
launching. Importing it lets a :class:`~halopipe.Pipeline` called on a plain
System run decomposed under a process group (see :mod:`.pipeline`).
"""

from ..domain import DomainConfig
from ..pipeline import register_decomposition
from .comm import Comm, DistributedError
from .pipeline import scatter_for_pipeline
from .sharded import ShardedSystem

register_decomposition(scatter_for_pipeline)

__all__ = ["Comm", "DistributedError", "DomainConfig", "ShardedSystem", "scatter_for_pipeline"]
