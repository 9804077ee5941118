"""Domain decomposition: partition, halo, communication, sharded systems and distributed pipelines."""

from .comm import Comm, DistributedError
from .pipeline import DistributedModel, DistributedPipeline
from .sharded import DomainConfig, ShardedSystem

__all__ = ["Comm", "DistributedError", "DomainConfig", "ShardedSystem", "DistributedPipeline", "DistributedModel"]
