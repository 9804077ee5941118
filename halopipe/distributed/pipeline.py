"""Distributed drop-in replacements for :class:`~halopipe.Pipeline` and a single model.

``DistributedPipeline(pipeline, config)(sharded, stress=...)`` evaluates a
pipeline on a :class:`~halopipe.distributed.ShardedSystem` with exactly the
single-process evaluation code: one ghost plan at the widest halo, each model
taking the prefix of ghost rows its own halo needs (``halo="per_model"``) or
all of them (``halo="max"``). Results: global ``energy``/``energies``/``stress``,
``forces`` and produced fields for the owned rows, and ``halo`` statistics.
"""

from __future__ import annotations

from ..models.base import Model
from ..pipeline import Pipeline, evaluate
from .sharded import DomainConfig, ShardedSystem

__all__ = ["DistributedPipeline", "DistributedModel"]


class DistributedPipeline:
    """A pipeline evaluated across ranks (also fine with one rank or none).

    Parameters
    ----------
    pipeline : the :class:`~halopipe.Pipeline` (or a model) to evaluate.
    config : :class:`DomainConfig`; its ``halo`` mode is used here, its grid
        and skin must match those the system was scattered with.
    """

    def __init__(self, pipeline, config: DomainConfig | None = None) -> None:
        self.pipeline = pipeline if isinstance(pipeline, Pipeline) else Pipeline([pipeline])
        self.config = config or DomainConfig()
        self._pair_cache: dict = {}

    def __enter__(self) -> DistributedPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self._pair_cache.clear()

    def halo_of(self, model: Model) -> float:
        return self.pipeline.halo if self.config.halo == "max" else model.halo

    def __call__(self, sharded: ShardedSystem, stress: bool = False) -> dict:
        comm = sharded.comm
        comm.agree(self._problem(sharded, stress))
        with comm.guard("pipeline evaluation"):
            out = evaluate(self.pipeline, sharded, stress=stress, pair_cache=self._pair_cache, halo_of=self.halo_of)
        names = [name for row in self.pipeline.names for name in row]
        models = [s.model for g in self.pipeline.groups for s in g.steps]
        out["halo"] = {name: sharded.ghost_count(self.halo_of(m)) for name, m in zip(names, models)}
        out["halo"]["exchanged"] = sharded.plan.n_ghost
        return out

    def _problem(self, sharded: ShardedSystem, stress: bool) -> str | None:
        if not isinstance(sharded, ShardedSystem):
            return f"DistributedPipeline: expected a ShardedSystem, got {type(sharded).__name__}; use ShardedSystem.scatter(system, config)"
        problem = self.config.problem(sharded.world_size)
        if problem:
            return problem
        if float(self.config.skin) != sharded.skin:
            return (
                f"DistributedPipeline: config skin {self.config.skin} differs from the system's skin {sharded.skin}; "
                "scatter with the same DomainConfig"
            )
        missing = sorted(self.pipeline.required_fields() - set(sharded.schema))
        if missing:
            return f"DistributedPipeline: the system lacks field(s) {missing} that no step produces"
        if sharded.n_owned and not bool(sharded.positions.isfinite().all()):
            bad = int((~sharded.positions.isfinite().all(dim=1)).nonzero()[0])
            return f"atom {int(sharded.ids[bad])} has a non-finite position {sharded.positions[bad].tolist()}"
        return None


class DistributedModel(DistributedPipeline):
    """A single model evaluated across ranks; same interface as :class:`DistributedPipeline`."""

    def __init__(self, model: Model, config: DomainConfig | None = None) -> None:
        super().__init__(Pipeline([model]), config)
