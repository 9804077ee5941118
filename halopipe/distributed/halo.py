"""The halo: which ghost rows a rank receives, and how they are refreshed.

At each rebuild every rank lists the images of its owned atoms that fall
within the widest halo width of some brick (its own brick included, for
periodic images), sorted per destination by distance to that brick, and sends
each destination its list directly (one message per pair of ranks that
interact; no all-gather). The send counts go first, point to point, to the
plan's peers: the ranks whose bricks lie within reach, known to both sides
from the partition alone, so a rebuild's messages do not grow with the rank
count. A rank's ghost rows are what it received, sorted by
distance, so a model with a narrower halo uses a *prefix* of the ghost rows
and a refresh at width ``w`` only moves the rows within ``w``: nested halos
from one plan, each model paying only for its own width.

:class:`HaloGather` is the differentiable refresh: forward sends owner rows
to the ranks holding their ghosts; backward sends the ghost rows' gradients
back and sums them into the owners. :class:`HaloFold` is its adjoint, the
differentiable fold: ghost rows' values summed into their owners, whose
backward refreshes the ghost rows' gradients from the owners'.
"""

from __future__ import annotations

import math

import torch

from ..geometry import ImageSet
from ..sorting import stable_argsort
from .comm import Comm, Gathered

__all__ = ["HaloPlan", "HaloGather", "HaloFold"]


class HaloPlan:
    """Send and receive lists of one rank for the current partition.

    Built collectively from the images of the owned atoms (``ImageSet``).
    ``peers`` are the ranks that may send or receive images (every rank lists
    the others alike; ``None``: any rank). Ghost rows are ordered by
    distance; ``ghost_shift`` places a ghost row at ``r_owner + ghost_shift @ cell``.
    ``send_counts`` / ``recv_counts`` map peer ranks to row counts (non-zero only).
    """

    def __init__(self, comm: Comm, images: ImageSet, numbers: torch.Tensor, ids: torch.Tensor, peers: list[int] | None = None) -> None:
        self.comm = comm
        device = numbers.device
        order = stable_argsort(images.distance)
        if images.rank.numel() and not _all_equal(images.rank):  # by destination, then distance
            order = order.index_select(0, stable_argsort(images.rank.index_select(0, order)))
        # index_select: about half the time of indexing by a tensor on the CPU
        self.send_atom = images.atom.index_select(0, order)
        send_rank = images.rank.index_select(0, order)
        send_dist = images.distance.index_select(0, order)
        ranks, counts = torch.unique_consecutive(send_rank, return_counts=True)
        self.send_counts = dict(zip(ranks.tolist(), counts.tolist()))
        self.recv_counts = comm.exchange_counts(self.send_counts, peers)  # point to point with the peers only
        starts = dict(zip(self.send_counts, (torch.cumsum(counts, 0) - counts).tolist()))
        self.send_index = {d: self.send_atom[starts[d] : starts[d] + c] for d, c in self.send_counts.items()}
        self.send_dist = {d: send_dist[starts[d] : starts[d] + c] for d, c in self.send_counts.items()}
        self._counts_cache: dict[float, tuple[dict, dict, int]] = {}
        self._sources_cache: dict[float, torch.Tensor] = {}
        self._elements_cache: dict[tuple, torch.Tensor] = {}
        # One process: every ghost is an image of an owned atom, ordered as sent (ghost row k is owned row ghost_owner[k]),
        # so the plan needs no metadata message, and a refresh or fold is one indexed pass through ghost_sources.
        self.ghost_owner = None if comm.distributed else self.send_index.get(comm.rank, self.send_atom[:0])
        if self.ghost_owner is not None:
            self._own_images_only(images.shift.index_select(0, order), send_dist, numbers, ids)
            return
        # Metadata travels once per rebuild, in one message: species, id, image shift, and the distance as its bits.
        meta = torch.empty(order.numel(), 6, dtype=torch.int64, device=device)  # filled by columns: half the time of a cat
        meta[:, 0] = numbers.index_select(0, self.send_atom)
        meta[:, 1] = ids.index_select(0, self.send_atom)
        meta[:, 2:5] = images.shift.index_select(0, order)
        meta[:, 5] = send_dist.contiguous().view(torch.int64)
        received = self._exchange_rows(meta, torch.int64)
        recv_int = {s: rows[:, :5] for s, rows in received.items()}
        self.recv_dist = {s: rows[:, 5].contiguous().view(torch.float64) for s, rows in received.items()}
        blocks_int = torch.cat([recv_int[s] for s in sorted(recv_int)]) if recv_int else torch.zeros(0, 5, dtype=torch.int64, device=device)
        dists = [self.recv_dist[s] for s in sorted(self.recv_dist)]
        blocks_dist = torch.cat(dists) if dists else torch.zeros(0, dtype=torch.float64, device=device)
        # Each source sends in ascending distance: one source's block is in order already.
        ghost_order = stable_argsort(blocks_dist) if len(dists) > 1 else torch.arange(blocks_dist.numel(), device=device)
        rows = blocks_int.index_select(0, ghost_order)
        self.ghost_numbers, self.ghost_ids = rows[:, 0].contiguous(), rows[:, 1].contiguous()
        self.ghost_shift = rows[:, 2:5].contiguous()
        self.ghost_distance = blocks_dist.index_select(0, ghost_order)
        # Position in the sorted ghost rows of each received row, per source.
        where = torch.empty_like(ghost_order).index_copy_(0, ghost_order, torch.arange(ghost_order.numel(), device=device))
        self.recv_slot = {}
        offset = 0
        for s in sorted(recv_int):
            c = recv_int[s].shape[0]
            self.recv_slot[s] = where[offset : offset + c]
            offset += c

    def _own_images_only(self, shift: torch.Tensor, distance: torch.Tensor, numbers: torch.Tensor, ids: torch.Tensor) -> None:
        """The ghost rows of one process: its own images as sent (``ghost_owner``), with no metadata message to pack and unpack.

        The same ghost rows, in the same order, as the message would give
        (LJ 32k: ~0.5 ms less a rebuild).
        """
        rank, owner = self.comm.rank, self.ghost_owner
        self.recv_dist = {rank: distance} if owner.numel() else {}
        self.recv_slot = {rank: torch.arange(owner.numel(), device=owner.device)} if owner.numel() else {}
        self.ghost_numbers = numbers.index_select(0, owner).to(torch.int64)  # as the int64 message gives them
        self.ghost_ids = ids.index_select(0, owner).to(torch.int64)
        self.ghost_shift, self.ghost_distance = shift, distance

    def _exchange_rows(self, rows: torch.Tensor, dtype) -> dict[int, torch.Tensor]:
        parts = torch.split(rows.to(dtype), list(self.send_counts.values())) if self.send_counts else ()
        sends = dict(zip(self.send_counts, parts))
        shapes = {s: (c, rows.shape[1]) for s, c in self.recv_counts.items()}
        return self.comm.exchange(sends, shapes, dtype, rows.device)

    @property
    def n_ghost(self) -> int:
        return int(self.ghost_distance.numel())

    def counts(self, limit: float) -> tuple[dict[int, int], dict[int, int], int]:
        """Rows sent to / received from each peer for ghosts within ``limit``."""
        hit = self._counts_cache.get(limit)
        if hit is None:
            lim = torch.tensor([limit], dtype=torch.float64)
            send = {d: int(torch.searchsorted(v.cpu(), lim, right=True)) for d, v in self.send_dist.items()}
            recv = {s: int(torch.searchsorted(v.cpu(), lim, right=True)) for s, v in self.recv_dist.items()}
            hit = (send, recv, sum(recv.values()))
            self._counts_cache[limit] = hit
        return hit

    def forward_rows(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        """Ghost rows (within ``limit``) of a per-atom tensor, from the owners.

        The peers' rows arrive after the owned ones, and one gather through
        :meth:`ghost_sources` places every ghost row: the images of owned
        atoms straight from their rows, with no message to itself and no
        scattering of what arrived. LJ 32k on 2 ranks: a refresh of positions
        200 -> 139 µs, the same rows (``index_copy_`` took twice an
        ``index_select``'s time a row). Gathers go through element indices
        (:meth:`_take_rows`).
        """
        send, recv, _ = self.counts(limit)
        me, x = self.comm.rank, x.contiguous()
        sources = self.ghost_sources(limit, x.shape[0])

        def place(got: dict[int, torch.Tensor]) -> torch.Tensor:
            arrived = [got[s] for s in sorted(got) if got[s].shape[0]]
            return self._take_rows(torch.cat([x, *arrived]) if arrived else x, ("sources", limit), sources)

        if not self.comm.distributed:
            return place({})
        # Every rank makes each exchange, so the message tags stay in step; rows go straight into, and are read straight
        # out of, shared memory where they go that way (Comm.exchange).
        sends = {d: self._gathered(x, ("send", d, limit), self.send_index[d][:k]) for d, k in send.items() if d != me}
        shapes = {s: (k,) + tuple(x.shape[1:]) for s, k in recv.items() if s != me}
        return self.comm.exchange(sends, shapes, x.dtype, x.device, consume=place)

    def ghost_sources(self, limit: float, n_owned: int) -> torch.Tensor:
        """Each ghost row's (within ``limit``) row among the owned rows followed by the peers' arrived rows (ascending peer).

        A ghost that is an image of an owned atom comes from that atom's row.
        Made once per plan and limit.
        """
        sources = self._sources_cache.get(limit)
        if sources is None:
            send, recv, n_ghost = self.counts(limit)
            device = self.send_atom.device
            sources = torch.empty(n_ghost, dtype=torch.int64, device=device)
            offset = n_owned
            for s in sorted(recv):
                k = recv[s]
                if s == self.comm.rank:
                    sources.index_copy_(0, self.recv_slot[s][:k], self.send_index[s][:k])
                elif k:
                    sources.index_copy_(0, self.recv_slot[s][:k], torch.arange(offset, offset + k, device=device))
                    offset += k
            self._sources_cache[limit] = sources
        return sources

    def backward_rows(self, g: torch.Tensor, n_owned: int, limit: float) -> torch.Tensor:
        """Adjoint of :meth:`forward_rows`: ghost-row values summed into owners.

        The blocks are added in ascending source rank (its own images' block
        included, taken straight from ``g``), each in its received order.
        """
        send, recv, n_ghost = self.counts(limit)
        g = g.contiguous()
        out = g.new_zeros((n_owned,) + tuple(g.shape[1:]))
        if self.ghost_owner is not None:  # one process: each ghost row's source is an owned row
            return self._add_rows(out, ("sources", limit), self.ghost_sources(limit, n_owned), g[:n_ghost])
        me = self.comm.rank

        def add(got: dict[int, torch.Tensor]) -> torch.Tensor:
            if recv.get(me):
                got[me] = self._take_rows(g, ("slot", me, limit), self.recv_slot[me][: recv[me]])
            for d in sorted(send):
                if send[d]:
                    self._add_rows(out, ("send", d, limit), self.send_index[d][: send[d]], got[d])
            return out

        sends = {s: self._gathered(g, ("slot", s, limit), self.recv_slot[s][:k]) for s, k in recv.items() if s != me}
        shapes = {d: (k,) + tuple(g.shape[1:]) for d, k in send.items() if d != me}
        return self.comm.exchange(sends, shapes, g.dtype, g.device, consume=add)

    def _elements(self, key: tuple, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Flat indices of the elements of ``rows`` in a contiguous array of ``width`` elements a row, made once per plan and ``key``."""
        hit = self._elements_cache.get((key, width))
        if hit is None:
            hit = (rows[:, None] * width + torch.arange(width, device=rows.device)).reshape(-1)
            self._elements_cache[(key, width)] = hit
        return hit

    def _take_rows(self, x: torch.Tensor, key: tuple, rows: torch.Tensor) -> torch.Tensor:
        """``x.index_select(0, rows)``, the same values, through element indices where a row holds several.

        On the CPU ``index_select`` on the flat array takes two thirds of the
        time of rows of three, and ``index_add_`` (:meth:`_add_rows`) 0.6
        (19,000 of 32,000 rows: 69 -> 44 µs and 153 -> 92 µs).
        """
        return self._gathered(x.contiguous(), key, rows).tensor()

    def _gathered(self, x: torch.Tensor, key: tuple, rows: torch.Tensor) -> Gathered:
        """``x.index_select(0, rows)`` of contiguous ``x`` by element indices (:meth:`_take_rows`): a message gathered where it goes."""
        width = math.prod(x.shape[1:])
        elements = rows if width == 1 else self._elements(key, rows, width)
        return Gathered(x, elements, (rows.shape[0],) + tuple(x.shape[1:]))

    def _add_rows(self, out: torch.Tensor, key: tuple, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``out.index_add_(0, rows, values)`` through element indices (:meth:`_take_rows`); ``out`` is contiguous."""
        width = math.prod(out.shape[1:])
        if width == 1:
            return out.index_add_(0, rows, values)
        out.view(-1).index_add_(0, self._elements(key, rows, width), values.contiguous().view(-1))
        return out


def _all_equal(x: torch.Tensor) -> bool:
    low, high = torch.aminmax(x)
    return bool(low == high)


class HaloGather(torch.autograd.Function):
    """Differentiable refresh: owner rows -> ghost rows; backward sums home."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, limit: float, known=None):
        ctx.plan, ctx.n_owned = plan, x.shape[0]
        ctx.limit = limit
        # ``known``: the same rows already fetched this evaluation; skip the forward exchange.
        return known.clone() if known is not None else plan.forward_rows(x, limit)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.backward_rows(grad, ctx.n_owned, ctx.limit), None, None, None


class HaloFold(torch.autograd.Function):
    """Differentiable fold: ghost rows -> summed into their owners; backward refreshes the ghost rows' gradients."""

    @staticmethod
    def forward(ctx, x_ghost, plan: HaloPlan, n_owned: int, limit: float):
        ctx.plan, ctx.limit = plan, limit
        return plan.backward_rows(x_ghost, n_owned, limit)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.forward_rows(grad, ctx.limit), None, None, None
