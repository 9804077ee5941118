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

:func:`bind_local_rank` gives local rank ``r`` of ``size`` the ``threads``
CPUs ``r * threads`` to ``(r + 1) * threads - 1`` of those this process may
run on, counted one thread per physical core first (:func:`cores_for_rank`),
when every rank fits (``size * threads`` no more than those cores); with more
ranks than cores it leaves the scheduler alone, which then shares them best.
halopipe's launcher binds every rank it spawns; under ``torchrun`` a rank binds
only when nothing has bound it already (it may run on every core of the
machine); ``srun`` and ``mpirun`` bind their ranks themselves.
``HALOPIPE_BIND_CORES=0`` turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["bind_local_rank", "cores_for_rank", "cpu_list"]


def cores_for_rank(local_rank: int, size: int, threads: int, available: list[int], siblings=None) -> list[int] | None:
    """The CPUs of ``available`` local rank ``local_rank`` of ``size`` should run on, ``threads`` each; None when they do not all fit.

    CPUs are handed out first threads of physical cores first, then second
    threads, so ranks (and a rank's threads) share no core while cores are
    left, whether the machine numbers a core's hardware threads apart (x86
    Linux: 0..N-1, then N..2N-1) or side by side (0-3 one core).
    ``siblings(cpu)``: the CPUs of ``cpu``'s core (default: Linux's topology
    files; a CPU alone when they cannot be read).
    """
    if size < 1 or threads < 1 or not 0 <= local_rank < size or size * threads > len(available):
        return None
    siblings = siblings or _thread_siblings

    def thread_of_core(cpu: int) -> int:  # 0 for a core's first hardware thread, 1 for its second, ...
        core = sorted(siblings(cpu))
        return core.index(cpu) if cpu in core else 0

    ordered = sorted(available, key=lambda cpu: (thread_of_core(cpu), cpu))
    return ordered[local_rank * threads : (local_rank + 1) * threads]


def _thread_siblings(cpu: int) -> list[int]:
    """The CPUs sharing ``cpu``'s physical core, from ``/sys`` (``[cpu]`` where it cannot be read)."""
    try:
        return cpu_list(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text())
    except (OSError, ValueError):
        return [cpu]


def cpu_list(text: str) -> list[int]:
    """The CPUs of a Linux CPU list such as ``"0-3,8,10-11"``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


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
