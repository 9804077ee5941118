"""Binding ranks to cores: each local rank keeps its own cores for the whole run.

Left to the scheduler, the ranks of a job migrate between cores whenever some
other thread wakes up (the launcher, gloo's threads, the system). A rank that
loses its core for part of a step, or comes back to cold caches, makes every
other rank wait at the next collective. On a 2-core machine, particle-mesh D3
of Si 4,096 on 2 unbound ranks took 0.16-0.18 s a call, one rank's
coordination-number walk 10-20% slower than the other's in each run (which rank
varied from run to run); bound, 0.135-0.142 s, the walks equal
(docs/benchmarks.md). MPI launchers bind their ranks by default for the same
reason.

:func:`bind_local_rank` gives local rank ``r`` of ``size`` the cores
``r * threads`` to ``(r + 1) * threads - 1`` of those this process may run on,
when every rank fits (``size * threads`` no more than those cores); with more
ranks than cores it leaves the scheduler alone, which then shares them best.
halopipe's launcher binds every rank it spawns; under ``torchrun`` a rank binds
only when nothing has bound it already (it may run on every core of the
machine); ``srun`` and ``mpirun`` bind their ranks themselves.
``HALOPIPE_BIND_CORES=0`` turns it off.
"""

from __future__ import annotations

import os

__all__ = ["bind_local_rank", "cores_for_rank"]


def cores_for_rank(local_rank: int, size: int, threads: int, available: list[int]) -> list[int] | None:
    """The cores of ``available`` local rank ``local_rank`` of ``size`` should run on, ``threads`` each; None when they do not all fit."""
    if size < 1 or threads < 1 or not 0 <= local_rank < size or size * threads > len(available):
        return None
    ordered = sorted(available)
    return ordered[local_rank * threads : (local_rank + 1) * threads]


def bind_local_rank(local_rank: int, size: int, threads: int, only_if_unbound: bool = False) -> list[int] | None:
    """Bind this process to its cores (:func:`cores_for_rank`); returns them, or None when it left the binding alone.

    ``only_if_unbound``: bind only if this process may run on every core of the
    machine (nothing, such as ``srun`` or ``taskset``, has chosen its cores).
    """
    if os.environ.get("HALOPIPE_BIND_CORES", "1").strip() == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    available = sorted(os.sched_getaffinity(0))
    if only_if_unbound and len(available) != (os.cpu_count() or 0):
        return None
    cores = cores_for_rank(local_rank, size, threads, available)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores
