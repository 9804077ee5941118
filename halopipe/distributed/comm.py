"""Communication for domain decomposition, on top of ``torch.distributed``.

:class:`Comm` is the only place that talks to other ranks. It offers

* point-to-point exchange of tensors with a few peers (``exchange``), used by
  the halo and by migration: no all-gather of positions anywhere;
* reductions (``all_reduce``) and a differentiable global sum whose backward
  is again a global sum (``GlobalSum``);
* error agreement: ``agree`` turns a local problem on any rank into the same
  :class:`DistributedError` on every rank, before any data moves, and
  ``guard`` reports an exception raised mid-way to the other ranks through the
  rendezvous store, so they end with the failing rank's message instead of
  hanging (at the latest after the configured timeout).

Without an initialised process group (or with one rank) every operation is
local, so the same code serves single-process use.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist

__all__ = ["Comm", "DistributedError", "GlobalSum"]


class DistributedError(RuntimeError):
    """An error on one rank, reported on every rank."""


class Comm:
    """A communicator over all ranks of the default process group.

    Parameters
    ----------
    timeout : seconds a rank waits for a peer before failing.
    """

    _created = 0  # communicators are created collectively, so this count agrees across ranks

    def __init__(self, timeout: float = 120.0) -> None:
        Comm._created += 1
        self._serial = Comm._created
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
        self._tag = 0
        self._calls = 0
        self.device = torch.device("cpu")
        if self.distributed:
            self.backend = dist.get_backend()
            if self.backend == "nccl":  # NCCL moves CUDA tensors only
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.group = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout))
            self._store = _default_store()

    # ----------------------------------------------------------- collectives
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduction over ranks (not differentiable); returns a new tensor."""
        if not self.distributed:
            return x.clone()
        y = x.detach().to(self.device, copy=True).contiguous()
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self.collectives += 1
        self.reduce_bytes += y.numel() * y.element_size()
        self._checked(lambda: dist.all_reduce(y, op=ops[op], group=self.group))
        return y.to(x.device)

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable sum over ranks."""
        if not self.distributed:
            return x
        return GlobalSum.apply(x, self)

    def all_to_all(self, x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """Send consecutive pieces of the 1-D tensor ``x`` (``send_sizes[r]`` elements to rank ``r``).

        Returns the received pieces concatenated by source rank (``recv_sizes``);
        one ``all_to_all_single`` (gloo and NCCL). Not differentiable by itself.
        """
        if not self.distributed:
            return x.clone()
        y = torch.empty(sum(recv_sizes), dtype=x.dtype, device=self.device)
        t = x.detach().to(self.device).contiguous()
        self.bytes_sent += (sum(send_sizes) - send_sizes[self.rank]) * t.element_size()
        self.all_to_all_bytes += (sum(send_sizes) - send_sizes[self.rank]) * t.element_size()
        self.messages_sent += sum(1 for r, n in enumerate(send_sizes) if n and r != self.rank)
        self.collectives += 1
        self._checked(lambda: dist.all_to_all_single(y, t, recv_sizes, send_sizes, group=self.group))
        return y.to(x.device)

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
        self._checked(lambda: dist.gather(count, counts, dst=root, group=self.group))
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
        self._checked(lambda: dist.broadcast(buf, src=src, group=self.group))
        return buf.to(device)

    def exchange_counts(self, counts: list[int]) -> list[int]:
        """``counts[r]`` to rank ``r``; returns what each rank sent here (one all-to-all of ``P`` integers)."""
        if not self.distributed:
            return list(counts)
        got = self.all_to_all(torch.tensor(counts, dtype=torch.int64), [1] * self.size, [1] * self.size)
        return got.tolist()

    def all_gather_object(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.size
        self.collectives += 1
        self._checked(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast_object(self, obj, src: int = 0):
        if not self.distributed:
            return obj
        box = [obj]
        self.collectives += 1
        self._checked(lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def exchange(
        self, sends: dict[int, torch.Tensor], recv_shapes: dict[int, tuple], dtype: torch.dtype, device
    ) -> dict[int, torch.Tensor]:
        """Send ``sends[peer]`` to each peer and receive ``recv_shapes[peer]`` from each.

        A message to oneself is passed through locally. Empty messages are
        skipped on both sides (both sides know the sizes).
        """
        out: dict[int, torch.Tensor] = {}
        ops = []
        self._tag += 1
        for peer, tensor in sends.items():
            if tensor.shape[0] == 0:
                continue
            if peer == self.rank:
                out[peer] = tensor
                continue
            t = tensor.to(self.device).contiguous()
            self.bytes_sent += t.numel() * t.element_size()
            self.messages_sent += 1
            ops.append(dist.P2POp(dist.isend, t, peer, self.group, self._tag))
        for peer, shape in recv_shapes.items():
            if shape[0] == 0:
                out[peer] = torch.empty(shape, dtype=dtype, device=device)
                continue
            if peer == self.rank:
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            out[peer] = buf
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, self._tag))
        if ops:

            def run():
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            self._checked(run)
        return {peer: t.to(device) for peer, t in out.items()}

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
        if float(flag[0]) == 0.0:
            return
        problems = self.all_gather_object(problem)
        text = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
        raise DistributedError(text)

    @contextlib.contextmanager
    def guard(self, what: str):
        """Turn an exception on one rank into an error on every rank.

        The failing rank writes its message to the rendezvous store and waits
        (up to the timeout) for the others to see it; the others fail in their
        next communication (a timeout or a closed connection), read the
        message and raise it as their own :class:`DistributedError`.
        """
        self._calls += 1
        key = f"halopipe/{self._serial}/{self._calls}"
        try:
            yield
        except _PeerFailure as failure:
            raise self._peer_error(key, what) from failure.__cause__
        except DistributedError:
            raise
        except Exception as exc:
            if not self.distributed:
                raise
            if isinstance(exc, RuntimeError) and self._someone_reported(key):
                raise self._peer_error(key, what) from exc
            message = f"rank {self.rank} failed during {what}: {type(exc).__name__}: {exc}"
            self._store.set(f"{key}/error/{self.rank}", message)
            self._wait_for_acks(key)
            raise DistributedError(message) from exc

    def _checked(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # a peer failed or timed out
            raise _PeerFailure(f"rank {self.rank}: communication with its peers failed: {exc}") from exc

    def _someone_reported(self, key: str) -> bool:
        """Has another rank already written its error for this guarded call?"""
        with contextlib.suppress(Exception):
            return any(self._store.check([f"{key}/error/{r}"]) for r in range(self.size) if r != self.rank)
        return False

    def _peer_error(self, key: str, what: str) -> DistributedError:
        deadline = time.monotonic() + min(self.timeout, 30.0)
        while True:
            for r in range(self.size):
                k = f"{key}/error/{r}"
                with contextlib.suppress(Exception):
                    if self._store.check([k]):
                        message = self._store.get(k).decode()
                        self._store.set(f"{key}/ack/{self.rank}", "1")
                        return DistributedError(f"{message} (reported on rank {self.rank})")
            if time.monotonic() > deadline:
                return DistributedError(
                    f"rank {self.rank}: communication failed during {what} and no rank reported a cause (a peer may have died)"
                )
            time.sleep(0.05)

    def _wait_for_acks(self, key: str) -> None:
        deadline = time.monotonic() + self.timeout + 5.0
        others = [f"{key}/ack/{r}" for r in range(self.size) if r != self.rank]
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self._store.check(others):
                    return
            time.sleep(0.05)

    def close(self) -> None:
        if self.distributed and self.group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
            self.group = None


class _PeerFailure(DistributedError):
    """A communication call failed; inside :meth:`Comm.guard` the cause is looked up in the store."""


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
