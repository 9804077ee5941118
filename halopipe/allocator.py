"""The C allocator's policy for the megabyte tensors of every step: keep freed memory for the next step.

glibc serves each block above its mmap threshold (128 KiB, raised on the fly
up to 32 MiB) with fresh pages from the system, unmaps them when the block is
freed, and gives the top of its heap back once more than twice that is free.
An MD step allocates and frees the same few-megabyte tensors (meshes, FFT
buffers, transpose messages) again and again, so every step pays a page fault
at the first write of each fresh page. :func:`keep_freed_memory` raises both
thresholds (``mallopt``): those blocks then come from and go back to the heap,
whose pages stay mapped, and after a few steps a step faults no pages.
Measured on particle-mesh D3 of Si 4,096 (AMD EPYC, one thread per rank, best
calls of two benchmark runs): 0.265 -> 0.255 s on one process and 0.156 -> 0.144 s
on two ranks, whose distributed FFT allocates many such buffers. The price is a
resident set that stays at its high-water mark, which a simulation reaches
every step anyway.

halopipe's launcher applies it in every rank it starts, as does the command
line tool; a Python-API user may call it once. ``HALOPIPE_KEEP_FREED_MEMORY=0``
turns it off. Without glibc's ``mallopt`` (macOS, musl) it does nothing.

Blocks beyond glibc's largest threshold (32 MiB: the D3 coordination walk's
chain slots, the pair search's per-row slots) are pooled by their owners
instead, in a :class:`~halopipe.scratch.ScratchPool`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if applied (see the module docstring)."""
    if os.environ.get("HALOPIPE_KEEP_FREED_MEMORY", "1").strip() == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
