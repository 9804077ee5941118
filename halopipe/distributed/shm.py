"""Shared memory between the ranks of one host: small reductions and halo messages without gloo's threads.

Why: a gloo operation hands its work to gloo's worker and transport threads
and the caller sleeps until they finish. Right after a compute phase that
costs 1-5 ms per operation on a virtual machine (idle virtual CPUs and
sleeping threads have to be woken), about 0.3 ms back to back; an MD step
makes three to eight of them. MPI on one node avoids that by polling shared
memory from the calling thread; this module does the same for the
operations of a step that fit its buffers.

How: one file in ``/dev/shm`` per shared process group, mapped by every rank
and unlinked as soon as all have mapped it (nothing is left behind, whatever
happens to the processes). It holds

* per rank, a control line: its pid and two reduction counters;
* per rank, a reduction slot;
* per ordered pair of ranks ``(src, dst)``, a mailbox: a ``sent`` counter that
  ``src`` bumps after writing a message, a ``taken`` counter that ``dst``
  bumps once it has read it, and the message buffer.

A reduction is: wait until every rank finished reading the previous one
(``done``), write my slot, bump ``posted``, wait until every rank posted,
sum the slots in rank order (so every rank gets bitwise the same result),
bump ``done``. A message is: wait until the receiver took my previous one,
write, bump ``sent``; the receiver waits for ``sent``, copies it out (or
reads it where it lies: the halo's refresh and fold), bumps ``taken``. A
sender may also make the message in the mailbox (the halo gathers its rows
there). Both sides know every message's size (as with gloo), so both
route it the same way: a message or reduction larger than the buffers goes
through gloo, and so does everything else (broadcasts, all-to-all, objects).

Publishing a message by a counter store after the payload stores relies on
x86-64's total store order; on other processors, or where ``/dev/shm`` is
missing or too small, or with ``HALOPIPE_SHM_CAPACITY=0``, gloo does all.

Waiting spins (yielding the core to any other runnable thread) for
``SPIN_SECONDS``, then sleeps in short naps (at once when the host has fewer
cores than ranks: a spinning rank would take the core a peer needs); every
``poll`` seconds it calls
back into :class:`~halopipe.distributed.comm.Comm`, which raises a failure a
peer reported, a peer that died, or the timeout.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import platform
import time
import uuid

import numpy as np
import torch

__all__ = ["SharedMemory", "capacity_from_environment", "spin_wait"]

LINE = 128  # bytes per counter line: two cache lines, so neighbours' counters never share one (or its prefetch pair)
DEFAULT_CAPACITY = 4 << 20  # bytes per reduction slot and per mailbox (a PME mesh of 60^3 float64 fits a slot)
MIN_CAPACITY = 64 << 10
BUDGET = 256 << 20  # most bytes of /dev/shm one group maps (pages are only allocated when written)
SPIN_SECONDS = 0.02  # spin (yielding) this long before napping: longer than the usual load imbalance of a step
NAP_SECONDS = 2e-4
_PID, _POSTED, _DONE = 0, 1, 2  # int64 fields of a rank's control line
_SENT, _TAKEN = 0, LINE // 8  # int64 fields of a mailbox header (two lines: one written by each side)


def capacity_from_environment() -> int:
    """Bytes per buffer asked for by ``HALOPIPE_SHM_CAPACITY`` (0: off), else :data:`DEFAULT_CAPACITY`."""
    text = os.environ.get("HALOPIPE_SHM_CAPACITY", "").strip()
    if not text:
        return DEFAULT_CAPACITY
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"HALOPIPE_SHM_CAPACITY must be a number of bytes (0 turns shared memory off), got {text!r}") from None
    return max(value, 0)


def _layout(size: int, capacity: int) -> tuple[int, int] | None:
    """Bytes per buffer and in all for ``size`` ranks, shrunk to fit the budget and the free space; None if it cannot."""
    try:
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
    except OSError:
        return None
    limit = min(BUDGET, free // 2)
    buffers = size + size * (size - 1)  # reduction slots and mailboxes
    capacity = min(capacity, (limit - size * LINE - 2 * LINE * size * size) // buffers // LINE * LINE)
    if capacity < MIN_CAPACITY:
        return None
    return capacity, size * LINE + size * capacity + size * (size - 1) * (2 * LINE + capacity)


class SharedMemory:
    """The mapped segment of one process group and this rank's view of it (see the module docstring).

    Made by :meth:`create` (collective); ``None`` there means gloo does all.
    """

    def __init__(self, mapping: mmap.mmap, rank: int, size: int, capacity: int) -> None:
        self.rank, self.size, self.capacity = rank, size, capacity
        self._mapping = mapping
        control = np.frombuffer(mapping, dtype=np.int64, count=size * LINE // 8)
        self._control = [control[r * LINE // 8 : (r + 1) * LINE // 8] for r in range(size)]
        raw = torch.frombuffer(mapping, dtype=torch.uint8)
        base = size * LINE
        self._slots = [raw[base + r * capacity : base + (r + 1) * capacity] for r in range(size)]
        base += size * capacity
        self._headers: dict[tuple[int, int], np.ndarray] = {}
        self._boxes: dict[tuple[int, int], torch.Tensor] = {}
        for src in range(size):
            for dst in range(size):
                if src != dst:
                    self._headers[src, dst] = np.frombuffer(mapping, dtype=np.int64, count=2 * LINE // 8, offset=base)
                    self._boxes[src, dst] = raw[base + 2 * LINE : base + 2 * LINE + capacity]
                    base += 2 * LINE + capacity
        self._typed: dict[tuple, torch.Tensor] = {}  # buffers viewed as a dtype, made once (see _as)
        self._reductions = 0
        self.watch_peers = True  # whether dead_peer can tell (see create)
        self.spin_seconds = SPIN_SECONDS if size <= (os.cpu_count() or 1) else 0.0

    # ------------------------------------------------------------- creation
    @classmethod
    def create(cls, rank: int, size: int, store, key: str, agree_all) -> SharedMemory | None:
        """Map one segment on every rank (collective), or return ``None`` on every rank if any cannot.

        Rank 0 creates the file and names it (and the buffer size) in
        ``store`` under ``key``; the others map it and write their pids;
        ``agree_all(ok)`` (a min-reduction over the ranks) tells whether all
        did, after which rank 0 unlinks the file. A second agreement tells
        whether every rank can see every peer's pid (not so across PID
        namespaces); only then do slow waits watch for dead peers.
        """
        wanted = capacity_from_environment() if size > 1 and platform.machine() in ("x86_64", "AMD64") else 0
        if rank == 0:
            layout = _layout(size, wanted) if wanted else None
            path = f"/dev/shm/halopipe-{uuid.uuid4().hex}" if layout is not None else ""
            if path and not _make_file(path, layout[1]):
                path = ""
            store.set(key, f"{path}|{layout[0] if path else 0}")
        named, _, announced = store.get(key).decode().partition("|")
        capacity = int(announced)
        mapping = _map(named, capacity) if named and wanted else None
        if mapping is not None:
            np.frombuffer(mapping, dtype=np.int64, count=1, offset=rank * LINE)[_PID] = os.getpid()
        ok = agree_all(mapping is not None)
        if rank == 0 and named:
            with contextlib.suppress(OSError):
                os.unlink(named)
        if not ok:
            return None
        shm = cls(mapping, rank, size, capacity)
        shm.watch_peers = agree_all(shm.dead_peer() is None)
        return shm

    # ---------------------------------------------------------- operations
    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.capacity

    def _as(self, key: tuple, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``buffer`` (a slot or a mailbox, ``key`` names it) as a flat ``dtype`` tensor, viewed once.

        Why: a step makes a handful of these operations, and each spent
        about as long slicing and re-viewing raw bytes as copying its payload.
        """
        typed = self._typed.get((key, dtype))
        if typed is None:
            typed = self._typed[key, dtype] = buffer.view(dtype)  # capacities are whole lines: every itemsize divides them
        return typed

    def all_reduce(self, x: torch.Tensor, op: str, wait) -> torch.Tensor:
        """The reduction of the contiguous CPU tensor ``x`` over the ranks, summed in rank order (caller checks :meth:`fits`)."""
        seq = self._reductions + 1
        control, me, n = self._control, self.rank, x.numel()
        wait(lambda: all(line[_DONE] >= seq - 1 for line in control))  # nobody still reads my slot
        self._as(("slot", me), self._slots[me], x.dtype)[:n].copy_(x.reshape(-1))
        control[me][_POSTED] = seq
        wait(lambda: all(line[_POSTED] >= seq for line in control))
        parts = [self._as(("slot", r), slot, x.dtype)[:n] for r, slot in enumerate(self._slots)]
        combine = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
        out = combine(parts[0], parts[1])  # a new tensor; the size is at least 2 (one rank needs no shared memory)
        for part in parts[2:]:
            combine(out, part, out=out)
        control[me][_DONE] = seq
        self._reductions = seq
        return out if x.dim() == 1 else out.view(x.shape)

    def send(self, dst: int, x: torch.Tensor, wait) -> None:
        """Write the CPU tensor ``x`` (any strides) to ``dst``'s mailbox from this rank (caller checks :meth:`fits`)."""
        self.send_made(dst, tuple(x.shape), x.dtype, lambda box: box.copy_(x), wait)

    def send_made(self, dst: int, shape: tuple, dtype: torch.dtype, make, wait) -> None:
        """Send ``dst`` a message of ``shape`` and ``dtype`` that ``make(box)`` writes straight into the mailbox (no copy)."""
        header = self._headers[self.rank, dst]
        wait(lambda: header[_TAKEN] == header[_SENT])  # the previous message was taken
        make(self._mailbox((self.rank, dst), shape, dtype))
        header[_SENT] += 1

    def receive(self, src: int, shape: tuple, dtype: torch.dtype, wait) -> torch.Tensor:
        """The next message from ``src``, copied out, as a tensor of ``shape`` and ``dtype``."""
        out = torch.empty(shape, dtype=dtype)
        self.receive_into(src, out, wait)
        return out

    def receive_into(self, src: int, out: torch.Tensor, wait) -> None:
        """Copy the next message from ``src`` into the CPU tensor ``out`` (any strides; its shape and dtype are the message's)."""
        self.read_in_place({src: tuple(out.shape)}, out.dtype, lambda boxes: out.copy_(boxes[src]), wait)

    def read_in_place(self, shapes: dict[int, tuple], dtype: torch.dtype, read, wait):
        """``read({src: message})`` of the next message from each source in ``shapes``, read where it lies; returns what ``read`` returns.

        The messages are views of the mailboxes, released once ``read``
        returns: it must not keep them, nor communicate (a peer waits for
        its mailbox to be taken).
        """
        headers = [self._headers[src, self.rank] for src in shapes]
        for header in headers:
            wait(lambda header=header: header[_SENT] > header[_TAKEN])
        try:
            return read({src: self._mailbox((src, self.rank), shape, dtype) for src, shape in shapes.items()})
        finally:
            for header in headers:
                header[_TAKEN] += 1

    def _mailbox(self, pair: tuple[int, int], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The mailbox of ``pair`` (source, destination) as a message of ``shape`` and ``dtype``."""
        return self._as(pair, self._boxes[pair], dtype)[: math.prod(shape)].view(shape)

    def dead_peer(self) -> int | None:
        """A rank whose process is gone, or ``None`` (all on this host, so its pid can be asked)."""
        if not self.watch_peers:
            return None
        for r, line in enumerate(self._control):
            pid = int(line[_PID])
            if r == self.rank or pid <= 0:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return r
            except OSError:  # not ours to signal: alive
                continue
        return None


def spin_wait(ready, on_slow, poll: float, spin_seconds: float = SPIN_SECONDS) -> None:
    """Return once ``ready()``; spin (yielding) for ``spin_seconds``, then nap, calling ``on_slow(elapsed)`` every ``poll`` s."""
    if ready():
        return
    start = time.perf_counter()
    next_poll = start + poll
    while not ready():
        now = time.perf_counter()
        if now - start < spin_seconds:
            os.sched_yield()
        else:
            time.sleep(NAP_SECONDS)
        if now >= next_poll:
            on_slow(now - start)
            next_poll = now + poll


def _make_file(path: str, nbytes: int) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.ftruncate(fd, nbytes)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)


def _map(path: str, capacity: int) -> mmap.mmap | None:
    if capacity <= 0:
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # another host, or no access
        return None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
