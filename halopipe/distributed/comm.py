"""Communication for domain decomposition, on top of ``torch.distributed``.

:class:`Comm` is the only place that talks to other ranks. It offers

* point-to-point exchange of tensors with a few peers (``exchange``), used by
  the halo and by migration: no all-gather of positions anywhere; the send
  counts that precede them go to the same peers (``exchange_counts`` with
  ``peers``), so a rebuild talks to its neighbours only;
* reductions (``all_reduce``) and a differentiable global sum whose backward
  is again a global sum (``GlobalSum``);
* between ranks of one host, reductions and messages that fit its buffers go
  through shared memory polled by the calling thread
  (:mod:`halopipe.distributed.shm`), much faster after a compute phase
  than gloo's threaded operations; the results are the same;
* sub-communicators (``split``): the ranks of one part of a partition, for
  collectives among a few ranks (the rows and columns of a pencil FFT);
* error agreement: ``agree`` turns a local problem on any rank into the same
  :class:`DistributedError` on every rank, before any data moves, and
  ``guard`` reports an exception raised mid-way to the other ranks through the
  rendezvous store.

Failing fast: with gloo, every collective and exchange runs asynchronously and
the waiting rank looks at the store whenever an operation takes longer than
``POLL_SECONDS``. A rank that fails inside ``guard`` writes its message and
bumps a failure counter there, so its peers stop waiting within one poll and
raise its message; it then waits only until every other rank has either seen
the failure or failed itself (so the same error on all ranks ends at once).
A peer that stalls without failing is caught by the group's timeout.
Sub-communicators poll the same way and report under their parent's keys and
ranks, so a failure on any rank ends the waits in every part.

Communicators with the same timeout share one process group (created on first
use, collectively; released by ``dist.destroy_process_group()``), so scattering
many systems does not accumulate sockets and threads. A group that saw a
failure is spent: it may hold abandoned operations, so it is dropped from the
cache and its communicators raise the failure again if used.

Without an initialised process group (or with one rank) every operation is
local, so the same code serves single-process use.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .shm import SharedMemory, spin_wait

__all__ = ["Comm", "DistributedError", "Gathered", "GlobalSum"]

POLL_SECONDS = 0.05  # a wait longer than this checks the store for peer failures, then every POLL_SECONDS
REPORT_GRACE_SECONDS = 1.0  # after a communication error, how long to look for a peer's reported cause
TOLD_WAIT_SECONDS = 3.0  # how long a rank that read a peer's report stays for the others to read it
CONNECT_SECONDS = 300.0  # how long creating a group waits for the other ranks (operations then use the timeout)
_COUNTERS = ("bytes_sent", "all_to_all_bytes", "messages_sent", "collectives", "reduce_bytes")


@dataclass(frozen=True)
class Gathered:
    """A message of the elements of contiguous ``source`` at flat indices ``elements``, shaped ``shape``.

    :meth:`Comm.exchange` gathers it straight into its shared-memory mailbox
    where it goes that way, instead of gathering it, then copying it in.
    """

    source: torch.Tensor
    elements: torch.Tensor
    shape: tuple

    def write(self, out: torch.Tensor) -> None:
        torch.index_select(self.source.view(-1), 0, self.elements, out=out.view(-1))

    def tensor(self) -> torch.Tensor:
        return self.source.view(-1).index_select(0, self.elements).view(self.shape)


class DistributedError(RuntimeError):
    """An error on one rank, reported on every rank.

    ``rank`` is the rank where the error arose (``None`` when unknown).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Comm:
    """A communicator over all ranks of the default process group.

    Parameters
    ----------
    timeout : seconds a rank waits for a peer before failing.
    """

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = float(timeout)
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.size = dist.get_world_size() if self.distributed else 1
        self.group = None
        # Traffic counters (read by benchmarks): point-to-point and all-to-all bytes and messages this rank
        # sent, collective calls, and the payload of all-reduces and broadcasts (the bytes on the wire
        # depend on the backend's algorithm: a ring all-reduce sends 2 (P - 1) / P times the payload).
        self.bytes_sent = 0
        self.all_to_all_bytes = 0  # the part of bytes_sent that went through all-to-all (PME transposes)
        self.messages_sent = 0
        self.collectives = 0
        self.reduce_bytes = 0
        self._parent: Comm | None = None  # set on a sub-communicator (``split``): its traffic counts there too
        self._forwarded = (0,) * len(_COUNTERS)
        self._report_rank, self._report_size = self.rank, self.size  # failure reports use the whole group's ranks
        self._tag = 0
        self._activity = "communication"
        self.failure_label = ""  # names what this rank is doing (an MD step) at the head of its failure reports
        self._shm: SharedMemory | None = None
        self.device = torch.device("cpu")
        if self.distributed:
            self.backend = dist.get_backend()
            if self.backend == "nccl":  # NCCL moves CUDA tensors only
                self.device = torch.device("cuda", torch.cuda.current_device())
            # NCCL work completes on the GPU stream; polling it would synchronise every call, so only gloo polls.
            self._polled = self.backend == "gloo"
            self._shared = _shared_group(self.timeout)
            self.group = self._shared.group
            self._shm = self._shared.shm  # ranks on one host: small reductions and messages through shared memory
            self._prefix = self._shared.prefix  # store keys of this group's failure reports
            self._store = _default_store()

    def split(self, parts: list[list[int]]) -> Comm:
        """The sub-communicator over the part of ``parts`` that holds this rank.

        ``parts`` divides this communicator's ranks into disjoint lists covering
        all of them, the same on every rank: every rank must call ``split``
        with the same ``parts`` (creating the groups is collective; they are
        created once per partition and kept with this communicator's group).
        In the result, ranks are positions within the part. It waits with the
        same polling and reports failures under this communicator's keys and
        ranks, so a failure on any rank ends the waits in every part, and its
        traffic is counted here too. A sub-communicator is not split again.
        """
        key = tuple(tuple(int(r) for r in part) for part in parts)
        if sorted(r for part in key for r in part) != list(range(self.size)) or not all(key):
            raise ValueError(f"Comm.split: parts must divide the ranks 0..{self.size - 1} into non-empty disjoint lists, got {parts}")
        if self._parent is not None:
            raise ValueError("Comm.split: a sub-communicator cannot be split again; split its parent")
        if not self.distributed or len(key) == 1:  # one part: this communicator itself
            return self
        groups = self._shared.parts.get(key)
        if groups is None:  # every rank creates every part's group, in the same order, as new_group requires
            groups = self._shared.parts[key] = [_new_group(self.timeout, list(part)) if len(part) > 1 else None for part in key]
        mine = next(i for i, part in enumerate(key) if self.rank in part)
        sub = copy.copy(self)
        sub.group, sub.rank, sub.size = groups[mine], key[mine].index(self.rank), len(key[mine])
        sub.distributed = sub.size > 1
        sub._parent, sub._forwarded, sub._tag = self, (0,) * len(_COUNTERS), 0
        sub._shm = None  # the segment's slots are indexed by the whole group's ranks
        for name in _COUNTERS:
            setattr(sub, name, 0)
        return sub

    # ----------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduction over ranks (not differentiable); returns a new tensor."""
        if not self.distributed:
            return x.clone()
        self.collectives += 1
        self.reduce_bytes += x.numel() * x.element_size()
        if self._through_shm(x.dtype, x.shape):
            z = x.detach().to(self.device).contiguous()  # no copy of a CPU tensor: the reduction copies it into its slot
            return self._run_shm(lambda wait: self._shm.all_reduce(z, op, wait)).to(x.device)
        y = x.detach().to(self.device, copy=True).contiguous()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self._run(lambda: [dist.all_reduce(y, op=ops[op], group=self.group, async_op=True)])
        return y.to(x.device)

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable sum over ranks."""
        if not self.distributed:
            return x
        return GlobalSum.apply(x, self)

    def all_to_all(self, x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """Send consecutive pieces of the 1-D tensor ``x`` (``send_sizes[r]`` elements to rank ``r``).

        Returns the received pieces concatenated by source rank (``recv_sizes``),
        through :meth:`all_to_all_into`. Not differentiable by itself.
        """
        y = x.new_empty(sum(recv_sizes))
        self.all_to_all_into(list(torch.split(x.detach(), send_sizes)), list(torch.split(y, recv_sizes)))
        return y

    def all_to_all_into(self, sends: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Send ``sends[r]`` to rank ``r`` and receive rank ``r``'s piece into ``outs[r]``; both may have any strides.

        ``outs`` are typically views of one result (the blocks of a transposed
        mesh), so pieces land in place. This rank's own piece is copied
        directly. Between ranks of one host each piece that fits is copied into
        shared memory and out of it into its view (both ends know its size, so
        both route it alike; the others go point to point through gloo);
        otherwise one ``all_to_all_single`` of packed buffers. Not
        differentiable by itself.
        """
        me = self.rank
        outs[me].copy_(sends[me])
        if not self.distributed:
            return
        dtype = outs[me].dtype
        others = [r for r in range(self.size) if r != me]
        sent = sum(sends[r].numel() * sends[r].element_size() for r in others)
        self.all_to_all_bytes += sent
        self.bytes_sent += sent
        self.messages_sent += sum(1 for r in others if sends[r].numel())
        self.collectives += 1
        self._tag += 1
        if self._shm is not None and self.device.type == "cpu":
            self._all_to_all_near(sends, outs, others, dtype)
            return
        send = torch.cat([s.reshape(-1) for s in sends]).to(self.device)
        recv_sizes = [o.numel() for o in outs]
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=self.device)
        self._run(lambda: [dist.all_to_all_single(recv, send, recv_sizes, [s.numel() for s in sends], group=self.group, async_op=True)])
        pieces = torch.split(recv, recv_sizes)
        for r in others:
            outs[r].copy_(pieces[r].view(outs[r].shape))

    def _all_to_all_near(self, sends: list[torch.Tensor], outs: list[torch.Tensor], others: list[int], dtype: torch.dtype) -> None:
        """:meth:`all_to_all_into` among ranks of one host: pieces that fit through shared memory, the rest point to point."""
        near_out = [r for r in others if sends[r].numel() and self._through_shm(dtype, sends[r].shape)]
        near_in = [r for r in others if outs[r].numel() and self._through_shm(dtype, outs[r].shape)]
        if near_out:
            self._run_shm(lambda wait: [self._shm.send(r, sends[r], wait) for r in near_out])
        far_out = [r for r in others if sends[r].numel() and r not in near_out]
        far_in = {r: torch.empty(outs[r].shape, dtype=dtype) for r in others if outs[r].numel() and r not in near_in}
        if far_out or far_in:
            ops = [
                dist.P2POp(dist.isend, sends[r].to(self.device).contiguous(), group=self.group, tag=self._tag, group_peer=r)
                for r in far_out
            ]
            ops += [dist.P2POp(dist.irecv, buf, group=self.group, tag=self._tag, group_peer=r) for r, buf in far_in.items()]
            self._run(lambda: dist.batch_isend_irecv(ops), p2p=True)
            for r, buf in far_in.items():
                outs[r].copy_(buf)
        if near_in:
            self._run_shm(lambda wait: [self._shm.receive_into(r, outs[r], wait) for r in near_in])

    def gather_rows(self, x: torch.Tensor, root: int = 0) -> torch.Tensor | None:
        """Every rank's rows of ``x`` concatenated in rank order on ``root`` (``None`` elsewhere).

        One gather of the row counts, then one message per rank to ``root``:
        ``root`` receives the ``N`` rows once, the others send only their own.
        """
        if not self.distributed:
            return x
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=self.device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)] if self.rank == root else None
        self.collectives += 1
        self._run(lambda: [dist.gather(count, counts, group_dst=root, group=self.group, async_op=True)])
        rows = tuple(x.shape[1:])
        shapes = {r: (int(c[0]),) + rows for r, c in enumerate(counts) if r != root} if self.rank == root else {}
        got = self.exchange({} if self.rank == root else {root: x}, shapes, x.dtype, x.device)
        if self.rank != root:
            return None
        return torch.cat([x if r == root else got[r] for r in range(self.size)])

    def broadcast(self, x: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device, src: int = 0) -> torch.Tensor:
        """``x`` (given on ``src``) on every rank; the others pass ``None`` and the known shape and dtype."""
        if not self.distributed:
            return x
        buf = x.detach().to(self.device).contiguous() if self.rank == src else torch.empty(shape, dtype=dtype, device=self.device)
        self.collectives += 1
        self.reduce_bytes += buf.numel() * buf.element_size()
        self._run(lambda: [dist.broadcast(buf, group_src=src, group=self.group, async_op=True)])
        return buf.to(device)

    def exchange_counts(self, counts: dict[int, int], peers: list[int] | None = None) -> dict[int, int]:
        """``counts[r]`` (absent: 0) to rank ``r``; returns the non-zero counts other ranks sent here, by rank.

        With ``peers`` (the ranks that may send or receive anything, the same
        relation on both sides: each rank lists the other), one integer goes
        to each peer and comes back from each: ``O(len(peers))`` messages.
        Without, one all-to-all of ``P`` integers (any rank may talk to any).
        A count for a rank outside ``peers`` is an error: that rank would not
        expect it.
        """
        if not self.distributed:
            return {r: c for r, c in counts.items() if c}
        if peers is None:
            sizes = [1] * self.size
            got = self.all_to_all(torch.tensor([counts.get(r, 0) for r in range(self.size)], dtype=torch.int64), sizes, sizes).tolist()
            return {r: c for r, c in enumerate(got) if c}
        others = set(peers) - {self.rank}
        stray = sorted(r for r, c in counts.items() if c and r != self.rank and r not in others)
        if stray:
            raise RuntimeError(f"rank {self.rank} has rows for ranks {stray}, which are not among its peers {sorted(others)}")
        one = torch.zeros(1, 1, dtype=torch.int64)
        sends = {r: one + counts.get(r, 0) for r in sorted(others)}
        got = self.exchange(sends, {r: (1, 1) for r in others}, torch.int64, torch.device("cpu"))
        received = {r: int(t[0, 0]) for r, t in got.items()}
        if counts.get(self.rank, 0):
            received[self.rank] = counts[self.rank]
        return {r: c for r, c in received.items() if c}

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, by rank (blocking; used after a collective all ranks reached)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        self.collectives += 1
        self._run(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank (blocking)."""
        if not self.distributed:
            return obj
        box = [obj]
        self.collectives += 1
        self._run(lambda: dist.broadcast_object_list(box, group_src=src, group=self.group))
        return box[0]

    def exchange(
        self,
        sends: dict[int, torch.Tensor | Gathered],
        recv_shapes: dict[int, tuple],
        dtype: torch.dtype,
        device,
        consume: Callable[[dict[int, torch.Tensor]], Any] | None = None,
    ) -> Any:
        """Send ``sends[peer]`` to each peer and receive ``recv_shapes[peer]`` from each, point to point.

        A message to oneself is passed through locally. Empty messages are
        skipped on both sides (both sides know the sizes). Between ranks of
        one host, messages that fit go through shared memory
        (:mod:`halopipe.distributed.shm`), the rest through gloo. (One gloo
        ``all_to_all_single`` per exchange was faster on 2 ranks here, but
        aborted a rank now and then under torchrun with 4 ranks, so it is not used.)

        Returns the received messages by peer, or ``consume(received)``:
        then messages in shared memory are read where they lie (no copy out),
        so ``consume`` must not keep them or communicate. A :class:`Gathered`
        message is gathered straight into its shared-memory mailbox (no
        copy in). The halo's refresh and fold use both: on two ranks each
        saves two copies of a 185 kB message.
        """
        out: dict[int, torch.Tensor] = {}
        outgoing: dict[int, torch.Tensor | Gathered] = {}
        self._tag += 1  # on every call, with or without messages, so the tags of all ranks stay in step
        for peer, message in sends.items():
            if message.shape[0] == 0:
                continue
            if isinstance(message, Gathered) and (peer == self.rank or not self._gathers_into_shm(message, dtype)):
                message = message.tensor()
            if peer == self.rank:
                out[peer] = message
                continue
            if isinstance(message, torch.Tensor):
                message = message.to(device=self.device, dtype=dtype).contiguous()
            self.bytes_sent += math.prod(message.shape) * dtype.itemsize
            self.messages_sent += 1
            outgoing[peer] = message
        incoming: dict[int, tuple] = {}
        for peer, shape in recv_shapes.items():
            if shape[0] == 0:
                out[peer] = torch.empty(shape, dtype=dtype, device=device)
            elif peer != self.rank:
                incoming[peer] = tuple(shape)
        # Both ends know each message's size, so both route it the same way: shared memory if it fits, else gloo.
        near_out = [p for p, t in outgoing.items() if self._through_shm(dtype, t.shape)]
        near_in = {p: shape for p, shape in incoming.items() if self._through_shm(dtype, shape)}
        if near_out:
            self._run_shm(lambda wait: [self._send_shm(p, outgoing.pop(p), wait) for p in near_out])
        incoming = {p: shape for p, shape in incoming.items() if p not in near_in}
        if outgoing or incoming:
            received = {peer: torch.empty(shape, dtype=dtype, device=self.device) for peer, shape in incoming.items()}
            ops = [dist.P2POp(dist.isend, t, group=self.group, tag=self._tag, group_peer=p) for p, t in outgoing.items()]
            ops += [dist.P2POp(dist.irecv, buf, group=self.group, tag=self._tag, group_peer=p) for p, buf in received.items()]
            self._run(lambda: dist.batch_isend_irecv(ops), p2p=True)
            out.update(received)
        if consume is None:
            if near_in:
                out.update(self._run_shm(lambda wait: {p: self._shm.receive(p, shape, dtype, wait) for p, shape in near_in.items()}))
            return {peer: t.to(device) for peer, t in out.items()}
        if near_in:

            def read(boxes: dict[int, torch.Tensor]):  # the messages in shared memory, where they lie
                return consume({peer: t.to(device) for peer, t in {**out, **boxes}.items()})

            return self._run_shm(lambda wait: self._shm.read_in_place(near_in, dtype, read, wait))
        return consume({peer: t.to(device) for peer, t in out.items()})

    def _gathers_into_shm(self, message: Gathered, dtype: torch.dtype) -> bool:
        """Whether ``message`` goes through shared memory and can be gathered straight into it (a CPU source of the message's dtype)."""
        return message.source.device.type == "cpu" and message.source.dtype == dtype and self._through_shm(dtype, message.shape)

    def _send_shm(self, peer: int, message: torch.Tensor | Gathered, wait) -> None:
        if isinstance(message, Gathered):
            self._shm.send_made(peer, message.shape, message.source.dtype, message.write, wait)
        else:
            self._shm.send(peer, message, wait)

    # ---------------------------------------------------------------- errors
    def agree(self, problem: str | None) -> None:
        """Raise the same error on every rank if any rank has a problem.

        Call it with ``None`` where all is well. It costs one one-element
        all-reduce; the messages are gathered only when some rank has one.
        """
        if not self.distributed:
            if problem:
                raise ValueError(problem)
            return
        flag = self.all_reduce(torch.tensor([1.0 if problem else 0.0]), "max")
        self.raise_agreed(problem, float(flag[0]) > 0.0)

    def raise_agreed(self, problem: str | None, anyone: bool) -> None:
        """The error of :meth:`agree` once a reduced flag (``anyone``: some rank has a problem) is known.

        Lets a caller carry the flag in a reduction it makes anyway (collective when ``anyone``).
        """
        if not anyone:
            return
        if not self.distributed:
            raise ValueError(problem)
        problems = self.all_gather_object(problem)
        text = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        raise DistributedError(text, rank=next(r for r, p in enumerate(problems) if p))

    @contextlib.contextmanager
    def guard(self, what: str):
        """Turn an exception on one rank into an error on every rank.

        The failing rank reports its message through the rendezvous store and
        waits until every other rank has seen it or failed itself (at most the
        timeout); ranks waiting in a communication see the report within
        ``POLL_SECONDS`` and raise it as their own :class:`DistributedError`.
        The message starts with :attr:`failure_label` (``"MD step 12: "``), so
        a rank that sees the report a step later still names the step.
        """
        self._activity = what
        try:
            yield
        except DistributedError:
            raise
        except Exception as exc:
            if not self.distributed:
                raise
            reported = self._reported_failure()  # a peer's failure that reached us wrapped (e.g. by autograd)
            if reported is not None:
                raise reported from exc
            message = f"{self.failure_label}rank {self._report_rank} failed during {what}: {type(exc).__name__}: {exc}"
            self._report(message)
            raise DistributedError(message, rank=self._report_rank) from exc
        finally:
            self._activity = "communication"

    # ------------------------------------------------------------- internals
    def _through_shm(self, dtype: torch.dtype, shape) -> bool:
        """Whether a reduction or message of ``shape`` and ``dtype`` goes through shared memory (CPU tensors only)."""
        if self._shm is None or self.device.type != "cpu" or dtype == torch.bool:
            return False
        return self._shm.fits(math.prod(shape) * dtype.itemsize)

    def _run_shm(self, operation):
        """Run ``operation(wait)`` on the shared segment, waiting as :meth:`_run` does (peer failures, dead peers, timeout)."""
        spent = self._shared.failure
        if spent is not None:
            raise DistributedError(f"this process group failed earlier: {spent}", rank=spent.rank)
        try:
            return operation(lambda ready: spin_wait(ready, self._check_while_waiting, POLL_SECONDS, self._shm.spin_seconds))
        except DistributedError as exc:
            self._spend(exc)
            raise

    def _check_while_waiting(self, elapsed: float) -> None:
        """A slow shared-memory wait: raise a failure a peer reported, a peer that died, or the timeout."""
        self._raise_reported_failure()
        dead = self._shm.dead_peer()
        if dead is not None:
            raise self._reported_failure(grace=REPORT_GRACE_SECONDS) or DistributedError(
                f"rank {self._report_rank}: rank {dead} died during {self._activity} without reporting a cause", rank=dead
            )
        if elapsed > self.timeout:
            raise DistributedError(
                f"rank {self._report_rank}: communication with its peers failed during {self._activity} and no rank reported a cause "
                f"(a peer stalled for longer than the {self.timeout:g} s timeout, or died)"
            )

    def _run(self, start, p2p: bool = False) -> None:
        """Run ``start()`` (async works, or ``None`` when it blocks) and wait for the works, watching for peer failures."""
        self._forward_traffic()
        spent = self._shared.failure
        if spent is not None:
            raise DistributedError(f"this process group failed earlier: {spent}", rank=spent.rank)
        try:
            works = start() or []
            if not self._polled:
                for work in works:
                    work.wait()
            elif p2p:
                self._wait_p2p(works)
            else:
                for work in works:
                    self._wait_collective(work)
        except DistributedError as exc:
            self._spend(exc)
            raise
        except Exception as exc:  # the group's timeout, or a peer that closed its connections
            failure = self._reported_failure(grace=min(REPORT_GRACE_SECONDS, self.timeout)) or DistributedError(
                f"rank {self._report_rank}: communication with its peers failed during {self._activity} and no rank reported a cause "
                f"(a peer stalled for longer than the {self.timeout:g} s timeout, or died): {_first_line(exc)}"
            )
            self._spend(failure)
            raise failure from exc

    def _wait_collective(self, work) -> None:
        """A timed wait on a gloo collective leaves it running, so wait in slices and check the store between them."""
        poll = datetime.timedelta(seconds=POLL_SECONDS)
        while True:
            try:
                work.wait(timeout=poll)
                return
            except RuntimeError:
                if work.is_completed():  # finished meanwhile, or failed: an untimed wait returns or raises its error
                    work.wait()
                    return
            self._raise_reported_failure()

    def _wait_p2p(self, works) -> None:
        """A timed wait on a gloo send/recv closes the connection, so a helper thread waits while this one checks the store."""
        job = _P2PWaiter.submit(works, datetime.timedelta(seconds=self.timeout))
        while not job.wait(POLL_SECONDS):
            try:
                self._raise_reported_failure()
            except DistributedError:
                _P2PWaiter.abandon()
                raise
        if job.error is not None:
            raise job.error

    def _raise_reported_failure(self) -> None:
        failure = self._reported_failure()
        if failure is not None:
            raise failure

    def _report(self, message: str) -> None:
        """Tell the other ranks about this rank's failure; wait until each has seen it or failed (at most the timeout)."""
        failure = DistributedError(message, rank=self._report_rank)
        self._spend(failure)
        with contextlib.suppress(Exception):  # the store may be gone with a dead rank 0: nobody left to tell
            self._store.set(f"{self._prefix}/error/{self._report_rank}", message)
            self._store.add(f"{self._prefix}/failed", 1)
            self._count_as_told()
            deadline = time.monotonic() + self.timeout
            while self._store.add(f"{self._prefix}/told", 0) < self._report_size and time.monotonic() < deadline:
                time.sleep(0.02)

    def _reported_failure(self, grace: float = 0.0) -> DistributedError | None:
        """A failure another rank reported to the store (looking for up to ``grace`` seconds), or ``None``."""
        deadline = time.monotonic() + grace
        while True:
            with contextlib.suppress(Exception):  # a store that cannot be reached holds no report
                if self._store.add(f"{self._prefix}/failed", 0) > 0:
                    for r in range(self._report_size):
                        key = f"{self._prefix}/error/{r}"
                        if r != self._report_rank and self._store.check([key]):
                            message = self._store.get(key).decode()
                            self._count_as_told()
                            self._await_everyone_told(min(self.timeout, TOLD_WAIT_SECONDS))
                            return DistributedError(f"{message} (reported on rank {self._report_rank})", rank=r)
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_SECONDS)

    def _await_everyone_told(self, limit: float) -> None:
        """Stay (at most ``limit`` s) until every rank has read the report.

        The rendezvous store may live in this process (rank 0 of a spawned
        group): leaving at once, as a failed rank does, would take the report
        away from ranks that have not read it yet.
        """
        deadline = time.monotonic() + limit
        with contextlib.suppress(Exception):  # a store that is gone has nobody left to serve
            while self._store.add(f"{self._prefix}/told", 0) < self._report_size and time.monotonic() < deadline:
                time.sleep(0.02)

    def _count_as_told(self) -> None:
        if not self._shared.told:
            self._shared.told = True
            self._store.add(f"{self._prefix}/told", 1)

    def _forward_traffic(self) -> None:
        """Add this sub-communicator's counts since the last call to its parent's (every counted operation runs through ``_run``)."""
        if self._parent is None:
            return
        now = tuple(getattr(self, name) for name in _COUNTERS)
        for name, before, after in zip(_COUNTERS, self._forwarded, now):
            setattr(self._parent, name, getattr(self._parent, name) + after - before)
        self._forwarded = now

    def _spend(self, failure: DistributedError) -> None:
        """After a failure the group may hold abandoned operations: no communicator may use it again."""
        if self._shared.failure is None:
            self._shared.failure = failure
        _GroupCache.groups = {t: g for t, g in _GroupCache.groups.items() if g is not self._shared}


class _Job(threading.Event):
    """Point-to-point works handed to the waiter thread; set when all completed (``error`` if one failed)."""

    def __init__(self, works, timeout: datetime.timedelta) -> None:
        super().__init__()
        self.works, self.timeout, self.error = works, timeout, None


class _P2PWaiter:
    """One daemon thread per process that waits on point-to-point works for the main thread.

    A waiter stuck on works abandoned after a peer's failure is left to the
    group's timeout; the next submission starts a fresh one. At interpreter
    exit the waiter is stopped and joined (``atexit``) and it never keeps a
    finished work alive: a thread still holding gloo objects while the
    process tears them down can abort it ("terminate called without an
    active exception").
    """

    jobs: queue.SimpleQueue | None = None
    thread: threading.Thread | None = None

    @classmethod
    def submit(cls, works, timeout: datetime.timedelta) -> _Job:
        if cls.jobs is None:
            cls.jobs = queue.SimpleQueue()
            cls.thread = threading.Thread(target=cls._serve, args=(cls.jobs,), name="halopipe-p2p-waiter", daemon=True)
            cls.thread.start()
        job = _Job(works, timeout)
        cls.jobs.put(job)
        return job

    @classmethod
    def abandon(cls) -> None:
        cls.jobs = cls.thread = None

    @classmethod
    def stop(cls) -> None:
        """End the waiter thread if it is idle (called at exit)."""
        if cls.jobs is not None and cls.thread is not None:
            cls.jobs.put(None)
            cls.thread.join(timeout=5.0)
        cls.abandon()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            try:
                for work in job.works:
                    work.wait(timeout=job.timeout)  # else send/recv would wait the group's (longer) connect timeout
            except Exception as exc:
                job.error = exc
            job.works = work = None  # release the works now, not when the next job arrives
            job.set()
            job = None


atexit.register(_P2PWaiter.stop)


class _SharedGroup:
    """A process group shared by the communicators of one timeout, and the failure that spent it (if any)."""

    created = 0  # groups are created collectively, so this count agrees across ranks

    def __init__(self, timeout: float) -> None:
        _SharedGroup.created += 1
        self.prefix = f"halopipe/{_SharedGroup.created}"
        self.told = False  # has this rank counted itself as aware of the failure?
        self.group = _new_group(timeout)
        self.shm = _shared_memory(self.group, self.prefix)
        self.parts: dict[tuple, list] = {}  # the groups of each partition split off this one (``Comm.split``)
        self.failure: DistributedError | None = None


def _new_group(timeout: float, ranks: list[int] | None = None):
    """A process group of ``ranks`` (all by default); collective over all ranks, members or not."""
    if dist.get_backend() != "gloo":
        return dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
    # Joining waits as long as joining the default group did: a rank may arrive late from reading its input.
    group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=max(timeout, CONNECT_SECONDS)))
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        group.set_timeout(datetime.timedelta(seconds=timeout))
    return group


def _shared_memory(group, prefix: str) -> SharedMemory | None:
    """The group's shared segment when its ranks share a host and use gloo (collective), else ``None``."""
    if dist.get_backend() != "gloo":
        return None

    def all_agree(ok: bool) -> bool:
        flag = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag[0] > 0)

    return SharedMemory.create(dist.get_rank(), dist.get_world_size(), _default_store(), f"{prefix}/shm", all_agree)


class _GroupCache:
    """One shared group per timeout, valid while the default group it was made from lives."""

    world = None
    groups: dict[float, _SharedGroup] = {}


def _shared_group(timeout: float) -> _SharedGroup:
    world = dist.distributed_c10d._get_default_group()
    if _GroupCache.world is not world:  # the default group was destroyed and created again
        _GroupCache.world, _GroupCache.groups = world, {}
    shared = _GroupCache.groups.get(timeout)
    if shared is None:
        shared = _GroupCache.groups[timeout] = _SharedGroup(timeout)
    return shared


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _default_store():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class GlobalSum(torch.autograd.Function):
    """Sum over ranks whose backward is a sum over ranks."""

    @staticmethod
    def forward(ctx, x, comm: Comm):
        ctx.comm = comm
        return comm.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad), None
