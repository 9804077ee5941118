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

A batch (``pipeline([s1, s2, ...])``) is placed by :func:`place_batch`: a
system with at least ``config.split_atoms`` atoms per rank is split in space
over all ranks (scattered as above, evaluated one after another); the others
go whole to one rank each, largest first to the rank with the fewest atoms so
far (the longest-processing-time rule, with cost taken as atom count), and
each rank evaluates its share as one local batch.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist

from ..batch import Batch, BatchPlacement
from ..domain import DomainConfig
from ..system import System
from .comm import Comm
from .launch import init_from_environment, launched_by_runner
from .sharded import ShardedSystem, _local_device

__all__ = ["scatter_for_pipeline", "place_batch", "balanced_placement"]


def scatter_for_pipeline(system: System | list | None, config: DomainConfig) -> ShardedSystem | BatchPlacement | None:
    """Rank 0's ``system`` split over the running process group (or its batch placed), ``None`` when there is at most one rank.

    Collective. Ranks other than 0 may pass the system too (their copy is
    ignored: rank 0's is the one scattered) or ``None``; rank 0 tells them
    whether it holds one system or a batch (:func:`place_batch`). Under a
    launcher whose process group the script has not joined, this joins it.
    """
    if not _several_ranks(config):
        return None
    is_batch = Comm(timeout=config.timeout).broadcast_object(isinstance(system, (list, tuple, Batch)) if dist.get_rank() == 0 else None)
    if is_batch:
        return place_batch(system if dist.get_rank() == 0 else None, config)
    return ShardedSystem.scatter(system if dist.get_rank() == 0 else None, config)


def _several_ranks(config: DomainConfig) -> bool:
    """Whether a process group of more than one rank runs (joining the launcher's group if the script has not)."""
    if launched_by_runner() and not (dist.is_available() and dist.is_initialized()):
        init_from_environment(timeout=config.timeout)
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def balanced_placement(sizes: list[int], n_ranks: int, split_atoms: int) -> tuple[list[int], list[list[int]]]:
    """Which systems of a batch are split over all ranks, and which go whole to each rank.

    A system with at least ``split_atoms * n_ranks`` atoms is split; the others
    are dealt largest first to the rank holding the fewest atoms so far (ties:
    the lowest rank), so ranks end within one system's atoms of each other.
    Returns ``(split indices, whole indices per rank)``, indices in batch order.
    """
    split = [b for b, n in enumerate(sizes) if n >= split_atoms * n_ranks]
    whole: list[list[int]] = [[] for _ in range(n_ranks)]
    loads = [(0, r) for r in range(n_ranks)]
    for b in sorted((b for b in range(len(sizes)) if b not in set(split)), key=lambda b: (-sizes[b], b)):
        load, rank = heapq.heappop(loads)
        whole[rank].append(b)
        heapq.heappush(loads, (load + sizes[b], rank))
    return split, [sorted(indices) for indices in whole]


def place_batch(systems: list | None, config: DomainConfig) -> BatchPlacement | None:
    """Rank 0's batch ``systems`` placed over the running process group, or ``None`` when there is at most one rank.

    Collective. Rank 0 checks the batch (an error on every rank if it is
    bad), decides the placement (:func:`balanced_placement`), sends every
    rank its whole systems and scatters each split system.
    """
    if not _several_ranks(config):
        return None
    comm = Comm(timeout=config.timeout)
    plan, problem = None, None
    if comm.rank == 0:
        problem, plan = _root_plan(systems, comm.size, config)
    comm.agree(problem)
    plan = comm.broadcast_object(plan)
    device = _local_device(plan["device"]) if comm.rank else torch.device(plan["device"])
    mine = [s.to(device=device) for s in plan["whole_systems"][comm.rank]]
    held = Batch(systems).systems if comm.rank == 0 else None  # checked by _root_plan
    split = [(b, ShardedSystem.scatter(held[b] if held is not None else None, config)) for b in plan["split"]]
    return BatchPlacement(
        sizes=plan["sizes"],
        dtype=plan["dtype"],
        device=device,
        whole=plan["whole"][comm.rank],
        whole_systems=mine,
        split=split,
        fields={k: v.to(device) for k, v in plan["fields"].items()},
        all_reduce=comm.all_reduce,
        guard=comm.guard,
        agree=comm.agree,
        share=comm.all_gather_object,
        is_root=comm.rank == 0,
    )


def _root_plan(systems, n_ranks: int, config: DomainConfig) -> tuple[str | None, dict | None]:
    """On rank 0: the batch's problem (or None) and its placement, with each rank's whole systems."""
    try:
        batch = Batch(systems if isinstance(systems, (list, tuple, Batch)) else [systems])
        for b, system in enumerate(batch.systems):
            try:
                system.check_close_contacts()
            except ValueError as exc:
                raise ValueError(f"system {b} of the batch: {exc}") from exc
    except (ValueError, TypeError) as exc:
        return f"Pipeline: {exc}", None
    split, whole = balanced_placement(batch.sizes, n_ranks, config.split_atoms)
    first = batch.systems[0]
    return None, {
        "sizes": batch.sizes,
        "dtype": first.dtype,
        "device": str(first.device),
        "split": split,
        "whole": whole,
        "whole_systems": [[batch.systems[b].to(device="cpu") for b in indices] for indices in whole],
        "fields": {k: v[:0].cpu() for k, v in first.fields.items()},
    }
