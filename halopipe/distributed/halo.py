"""The halo: which ghost rows a rank receives, and how they are refreshed.

At each rebuild every rank lists the images of its owned atoms that fall
within the widest halo width of some brick (its own brick included, for
periodic images) and sends each destination its list directly (one message
per pair of ranks that interact; no all-gather). The send counts go first,
point to point, to the plan's peers: the ranks whose bricks lie within reach,
known to both sides from the partition alone, so a rebuild's messages do not
grow with the rank count.

A plan serves the halo widths of a pipeline's models, one *band* each: an
image's band is the narrowest width that holds it. Rows go and arrive in band
order, so the ghosts of a model with a narrower halo are a *prefix* of the
ghost rows and a refresh at its width only moves those: nested halos from one
plan, each model paying only for its own width. Within a band rows keep the
owners' order (no sort by distance): neighbouring ghost rows lie near each
other, as owned rows do, which the kernels' caches reward.

:class:`HaloGather` is the differentiable refresh: forward sends owner rows
to the ranks holding their ghosts; backward sends the ghost rows' gradients
back and sums them into the owners. :class:`HaloFold` is its adjoint, the
differentiable fold: ghost rows' values summed into their owners, whose
backward refreshes the ghost rows' gradients from the owners'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..domain import band_ends, image_bands
from ..geometry import ImageSet
from ..sorting import stable_argsort
from .comm import Comm, Gathered

__all__ = ["HaloPlan", "HaloGather", "HaloFold"]


class HaloPlan:
    """Send and receive lists of one rank for the current partition.

    Built collectively from the images of the owned atoms (``ImageSet``).
    ``peers`` are the ranks that may send or receive images (every rank lists
    the others alike; ``None``: any rank). ``limits``: the bands' distance
    limits, ascending (one per halo width the plan serves; the last is the
    plan's width). Ghost rows are ordered by band, so band ``b``'s ghosts
    (every ghost within ``limits[b]``) are a prefix; ``ghost_shift`` places a
    ghost row at ``r_owner + ghost_shift @ cell``. ``send_counts`` /
    ``recv_counts`` map peer ranks to row counts (non-zero only). Refreshes
    and folds take a band index.
    """

    def __init__(
        self, comm: Comm, images: ImageSet, numbers: torch.Tensor, ids: torch.Tensor, peers: list[int] | None, limits: Sequence[float]
    ) -> None:
        self.comm = comm
        self.n_bands = len(limits)
        device = numbers.device
        band = image_bands(images.distance, limits)
        # By destination, then band; within those in the images' own order (the owned rows'), no sort where all are alike.
        key = images.rank.long() * self.n_bands + band
        order = stable_argsort(key) if key.numel() and not _all_equal(key) else torch.arange(key.numel(), device=device)
        # index_select: about half the time of indexing by a tensor on the CPU
        self.send_atom = images.atom.index_select(0, order)
        send_band = band.index_select(0, order)
        ranks, counts = torch.unique_consecutive(images.rank.index_select(0, order), return_counts=True)
        self.send_counts = dict(zip(ranks.tolist(), counts.tolist()))
        self.recv_counts = comm.exchange_counts(self.send_counts, peers)  # point to point with the peers only
        starts = dict(zip(self.send_counts, (torch.cumsum(counts, 0) - counts).tolist()))
        self.send_index = {d: self.send_atom[starts[d] : starts[d] + c] for d, c in self.send_counts.items()}
        self.send_ends = {d: band_ends(send_band[starts[d] : starts[d] + c], self.n_bands) for d, c in self.send_counts.items()}
        self._counts_cache: dict[int, tuple[dict, dict, int]] = {}
        self._sources_cache: dict[int, torch.Tensor] = {}
        self._elements_cache: dict[tuple, torch.Tensor] = {}
        # One process: every ghost is an image of an owned atom, ordered as sent (ghost row k is owned row ghost_owner[k]),
        # so the plan needs no metadata message, and a refresh or fold is one indexed pass through ghost_sources.
        self.ghost_owner = None if comm.distributed else self.send_index.get(comm.rank, self.send_atom[:0])
        if self.ghost_owner is not None:
            self._own_images_only(images.shift.index_select(0, order), send_band, numbers, ids)
            return
        # Metadata travels once per rebuild, in one message: species, id, image shift and band.
        meta = torch.empty(order.numel(), 6, dtype=torch.int64, device=device)  # filled by columns: half the time of a cat
        meta[:, 0] = numbers.index_select(0, self.send_atom)
        meta[:, 1] = ids.index_select(0, self.send_atom)
        meta[:, 2:5] = images.shift.index_select(0, order)
        meta[:, 5] = send_band
        received = self._exchange_rows(meta, torch.int64)
        sources = sorted(received)
        self.recv_ends = {s: band_ends(received[s][:, 5], self.n_bands) for s in sources}
        blocks = torch.cat([received[s] for s in sources]) if sources else torch.zeros(0, 6, dtype=torch.int64, device=device)
        # Each source sends in band order: with one band, or one source, the blocks are in order already.
        one_block = self.n_bands == 1 or len(sources) <= 1
        ghost_order = torch.arange(blocks.shape[0], device=device) if one_block else stable_argsort(blocks[:, 5])
        rows = blocks if one_block else blocks.index_select(0, ghost_order)
        self.ghost_numbers, self.ghost_ids = rows[:, 0].contiguous(), rows[:, 1].contiguous()
        self.ghost_shift = rows[:, 2:5].contiguous()
        self.ghost_band = rows[:, 5].contiguous()
        # Position in the ghost rows of each received row, per source.
        where = ghost_order
        if not one_block:
            where = torch.empty_like(ghost_order).index_copy_(0, ghost_order, torch.arange(ghost_order.numel(), device=device))
        self.recv_slot = {}
        offset = 0
        for s in sources:
            c = received[s].shape[0]
            self.recv_slot[s] = where[offset : offset + c]
            offset += c

    def _own_images_only(self, shift: torch.Tensor, band: torch.Tensor, numbers: torch.Tensor, ids: torch.Tensor) -> None:
        """The ghost rows of one process: its own images as sent (``ghost_owner``), with no metadata message to pack and unpack.

        The same ghost rows, in the same order, as the message would give
        (LJ 32k: ~0.5 ms less a rebuild).
        """
        rank, owner = self.comm.rank, self.ghost_owner
        self.recv_ends = {rank: self.send_ends[rank]} if owner.numel() else {}
        self.recv_slot = {rank: torch.arange(owner.numel(), device=owner.device)} if owner.numel() else {}
        self.ghost_numbers = numbers.index_select(0, owner).to(torch.int64)  # as the int64 message gives them
        self.ghost_ids = ids.index_select(0, owner).to(torch.int64)
        self.ghost_shift, self.ghost_band = shift, band

    def _exchange_rows(self, rows: torch.Tensor, dtype) -> dict[int, torch.Tensor]:
        parts = torch.split(rows.to(dtype), list(self.send_counts.values())) if self.send_counts else ()
        sends = dict(zip(self.send_counts, parts))
        shapes = {s: (c, rows.shape[1]) for s, c in self.recv_counts.items()}
        return self.comm.exchange(sends, shapes, dtype, rows.device)

    @property
    def n_ghost(self) -> int:
        return int(self.ghost_band.numel())

    def counts(self, band: int) -> tuple[dict[int, int], dict[int, int], int]:
        """Rows sent to / received from each peer for the ghosts of ``band`` (those within its limit), and their number."""
        hit = self._counts_cache.get(band)
        if hit is None:
            send = {d: ends[band] for d, ends in self.send_ends.items()}
            recv = {s: ends[band] for s, ends in self.recv_ends.items()}
            hit = self._counts_cache[band] = (send, recv, sum(recv.values()))
        return hit

    def forward_rows(self, x: torch.Tensor, band: int) -> torch.Tensor:
        """Ghost rows (of ``band``) of a per-atom tensor, from the owners.

        The peers' rows arrive after the owned ones, and one gather through
        :meth:`ghost_sources` places every ghost row: the images of owned
        atoms straight from their rows, with no message to itself and no
        scattering of what arrived. LJ 32k on 2 ranks: a refresh of positions
        200 -> 139 µs, the same rows (``index_copy_`` took twice an
        ``index_select``'s time a row). Gathers go through element indices
        (:meth:`_take_rows`).
        """
        send, recv, _ = self.counts(band)
        me, x = self.comm.rank, x.contiguous()
        sources = self.ghost_sources(band, x.shape[0])

        def place(got: dict[int, torch.Tensor]) -> torch.Tensor:
            arrived = [got[s] for s in sorted(got) if got[s].shape[0]]
            return self._take_rows(torch.cat([x, *arrived]) if arrived else x, ("sources", band), sources)

        if not self.comm.distributed:
            return place({})
        # Every rank makes each exchange, so the message tags stay in step; rows go straight into, and are read straight
        # out of, shared memory where they go that way (Comm.exchange).
        sends = {d: self._gathered(x, ("send", d, band), self.send_index[d][:k]) for d, k in send.items() if d != me}
        shapes = {s: (k,) + tuple(x.shape[1:]) for s, k in recv.items() if s != me}
        return self.comm.exchange(sends, shapes, x.dtype, x.device, consume=place)

    def ghost_sources(self, band: int, n_owned: int) -> torch.Tensor:
        """Each ghost row's (of ``band``) row among the owned rows followed by the peers' arrived rows (ascending peer).

        A ghost that is an image of an owned atom comes from that atom's row.
        Made once per plan and band.
        """
        sources = self._sources_cache.get(band)
        if sources is None:
            send, recv, n_ghost = self.counts(band)
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
            self._sources_cache[band] = sources
        return sources

    def backward_rows(self, g: torch.Tensor, n_owned: int, band: int) -> torch.Tensor:
        """Adjoint of :meth:`forward_rows`: ghost-row values summed into owners.

        The blocks are added in ascending source rank (its own images' block
        included, taken straight from ``g``), each in its received order.
        """
        send, recv, n_ghost = self.counts(band)
        g = g.contiguous()
        out = g.new_zeros((n_owned,) + tuple(g.shape[1:]))
        if self.ghost_owner is not None:  # one process: each ghost row's source is an owned row
            return self._add_rows(out, ("sources", band), self.ghost_sources(band, n_owned), g[:n_ghost])
        me = self.comm.rank

        def add(got: dict[int, torch.Tensor]) -> torch.Tensor:
            if recv.get(me):
                got[me] = self._take_rows(g, ("slot", me, band), self.recv_slot[me][: recv[me]])
            for d in sorted(send):
                if send[d]:
                    self._add_rows(out, ("send", d, band), self.send_index[d][: send[d]], got[d])
            return out

        sends = {s: self._gathered(g, ("slot", s, band), self.recv_slot[s][:k]) for s, k in recv.items() if s != me}
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
    def forward(ctx, x, plan: HaloPlan, band: int, known=None):
        ctx.plan, ctx.n_owned = plan, x.shape[0]
        ctx.band = band
        # ``known``: the same rows already fetched this evaluation; skip the forward exchange.
        return known.clone() if known is not None else plan.forward_rows(x, band)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.backward_rows(grad, ctx.n_owned, ctx.band), None, None, None


class HaloFold(torch.autograd.Function):
    """Differentiable fold: ghost rows -> summed into their owners; backward refreshes the ghost rows' gradients."""

    @staticmethod
    def forward(ctx, x_ghost, plan: HaloPlan, n_owned: int, band: int):
        ctx.plan, ctx.band = plan, band
        return plan.backward_rows(x_ghost, n_owned, band)

    @staticmethod
    def backward(ctx, grad):
        return ctx.plan.forward_rows(grad, ctx.band), None, None, None
