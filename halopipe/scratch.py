"""Scratch tensors kept between calls: memory the code owns, handed out again instead of allocated afresh.

Buffers beyond glibc's largest mmap threshold (32 MiB) are mapped afresh on
every allocation and fault each page at its first write, whatever
:func:`~halopipe.allocator.keep_freed_memory` says: the D3 coordination walk's
chain slots, the pair search's per-row slots. Their owners keep them in a
:class:`ScratchPool`.

Results that outlive the call are allocated afresh too, and glibc seldom
hands a block freed by the last result to the next one of about its size
(torch asks for 64-byte aligned blocks, and the aligned request is a little
larger than the block it freed), so each page of a fresh result faults
again: the pair search's 6 MB list cost LJ 32k 1.8 ms a rebuild in its copy
out of the scratch buffer. A buffer the pool *lends* (:meth:`ScratchPool.lend_flat`)
is handed out in views and comes back by itself once no view is left.
"""

from __future__ import annotations

import torch

__all__ = ["ScratchPool"]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it, lent buffers never come back


def _unreferenced(buffer: torch.Tensor) -> bool:
    """Whether no tensor but ``buffer`` itself refers to its memory (a view, a NumPy array, a Warp array made from it).

    The count includes ``buffer`` and the storage object asked for here.
    """
    return _storage_use_count is not None and _storage_use_count(buffer.untyped_storage()._cdata) <= 2


class ScratchPool:
    """Large scratch tensors kept between calls and handed out again, instead of allocated afresh.

    Hundreds of megabytes allocated anew on every call are mapped anew by the
    C allocator (glibc returns blocks beyond 32 MB to the system) and each page
    faults at its first write: on Si 4,096 that was 0.04 s of a 0.32 s D3
    evaluation, and more on two ranks sharing the memory bus. A tensor given
    back (:meth:`give`) once its contents are used goes to the next
    :meth:`take` of its shape; one still in use is never handed out twice.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []

    def take(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialised tensor of ``shape``: a given-back one if any, else a new one."""
        free = self._free.get((tuple(shape), dtype, torch.device(device)))
        return free.pop() if free else torch.empty(shape, dtype=dtype, device=device)

    def take_flat(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialised 1-D buffer of at least ``numel`` elements (give it back with :meth:`give_flat`).

        A given-back buffer long enough is handed out whole; a new one is an
        eighth longer than asked, so that requests that wander (a rank's owned
        atoms come and go) keep reusing it.
        """
        self._reclaim()
        free = self._free.get(("flat", dtype, torch.device(device)), [])
        fits = [k for k, t in enumerate(free) if t.numel() >= numel]
        return free.pop(fits[0]) if fits else torch.empty(numel + numel // 8, dtype=dtype, device=device)

    def lend_flat(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D buffer as :meth:`take_flat` gives, for a result that outlives the call: hand out views of it.

        It is not given back: the pool hands it out again only once no
        tensor but its own refers to its memory, so a result kept until the
        next rebuild (a pair list) reuses the pages of the one before last
        instead of faulting fresh ones.
        """
        buffer = self.take_flat(numel, dtype, device)
        self._lent.append(buffer)
        return buffer

    def _reclaim(self) -> None:
        """Give back the lent buffers nothing refers to any more."""
        lent, self._lent = self._lent, []
        for buffer in lent:
            if _unreferenced(buffer):
                self.give_flat(buffer)
            else:
                self._lent.append(buffer)

    def give_flat(self, buffer: torch.Tensor) -> None:
        """Hand back a buffer from :meth:`take_flat`; the longest ``keep`` are kept."""
        free = self._free.setdefault(("flat", buffer.dtype, buffer.device), [])
        free.append(buffer)
        free.sort(key=lambda t: t.numel())
        del free[: max(len(free) - self.keep, 0)]

    def give(self, *tensors: torch.Tensor) -> None:
        """Hand ``tensors`` back for reuse (their contents are no longer needed); at most ``keep`` per shape."""
        for t in tensors:
            free = self._free.setdefault((tuple(t.shape), t.dtype, t.device), [])
            if len(free) < self.keep:
                free.append(t)
