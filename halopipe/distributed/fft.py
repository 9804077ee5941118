"""A distributed 3-D real FFT on mesh slabs or pencils, differentiable end to end.

The ranks form a ``Pr x Pc`` process grid over the first two mesh axes: rank
``(i, j)`` holds the real-space block ``x0 in`` its ``i``-th piece of ``n0``,
``x1 in`` its ``j``-th piece of ``n1``, all of ``x2``. Pieces are balanced
(sizes differ by at most one), so no mesh size needs to divide by the grid; a
rank whose piece is empty holds nothing and still takes part. The forward
transform of an ``(n0, n1, n2)`` mesh, with ``h = n2 // 2 + 1``:

1. local real FFT along axis 2: ``(x0_i, x1_j, h)``;
2. transpose within the grid row (the ``Pc`` ranks sharing ``i``): every rank
   sends each row peer its part of that peer's ``k2`` piece and gathers all of
   ``x1``: ``(x0_i, n1, k2_j)``; local FFT along axis 1;
3. transpose within the grid column (the ``Pr`` ranks sharing ``j``): gather
   all of ``x0``, keep the ``i``-th piece of ``k1``: ``(n0, k1_i, k2_j)``;
   local FFT along axis 0.

The inverse runs the same steps backwards. Each transpose is one
``all_to_all_single`` in a row or column sub-communicator
(:meth:`~halopipe.distributed.comm.Comm.split`), so a rank exchanges messages
with ``Pr + Pc - 2`` ranks, ``O(sqrt P)`` on a square grid. The slab
decomposition is the grid ``P x 1``: step 2 needs no transpose (its FFT and
step 1's are one 2-D real FFT), and step 3 is one all-to-all among all ``P``
ranks. Each rank holds ``O(M / P)`` numbers at
every stage and sends ``O(M / P)`` per transpose. Every step is linear with an
exact adjoint (local FFTs through autograd, the transposes through
:class:`Transpose`, whose backward is the reverse transpose), so gradients
through the transform are exact.

Slab or pencil (:func:`choose_grid`): a grid is *full* when every rank holds
part of the mesh at every stage (``Pr <= min(n0, n1)``, ``Pc <= min(n1, h)``);
the slab is full only when ``P <= min(n0, n1)``. Among full grids the one with
the least modelled transpose time per rank is taken: ``messages x
MESSAGE_COST_BYTES + bytes`` (the busiest rank, one forward transform), where
a message costs as much as sending ``MESSAGE_COST_BYTES``. The slab sends the
fewest bytes, pencils the fewest messages, so pencils win on many ranks or
small meshes, and whenever ``P`` exceeds the mesh's first dimension. With no
full grid (``P`` too large for the mesh) the grid whose busiest rank holds the
least is taken.

:class:`BlockBoxMap` moves a rank's box of mesh values (its atoms' B-spline
support, ghost layer included) to the block owners, summing on arrival, and
reads a box back from the blocks: the mesh's halo exchange, differentiable
both ways. Box descriptors (six integers per rank) are all-gathered once per
map; the values travel point to point, only between ranks whose box and block
meet. Leading batch axes (several meshes, e.g. a model's channels) travel
with the mesh axes: one all-to-all per transpose and one message per peer for
the whole batch.
"""

from __future__ import annotations

import torch

from ..meshfft import BoxMap, MeshTransform, signed_frequencies
from .comm import Comm

__all__ = [
    "PencilMeshTransform",
    "SlabMeshTransform",
    "BlockBoxMap",
    "Transpose",
    "balanced_split",
    "choose_grid",
    "grid_cost",
    "distributed_mesh_transform",
    "DECOMPOSITIONS",
    "MESSAGE_COST_BYTES",
]

DECOMPOSITIONS = ("auto", "slab", "pencil")
# The latency of one message in bytes of bandwidth (latency x bandwidth): 64 KiB is 2.6 us at 25 GB/s, an
# InfiniBand HDR link's MPI latency. Lower (NVLink bandwidth with NCCL's launch latency is higher) favours slabs.
MESSAGE_COST_BYTES = 64 * 1024
_COMPLEX_BYTES = 16  # complex128: the transposes move the half spectrum in float64


def balanced_split(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` consecutive pieces whose sizes differ by at most one."""
    base, extra = divmod(int(n), int(parts))
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _starts(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _fft(fn, x: torch.Tensor, dim, norm: str, n: int | None = None) -> torch.Tensor:
    """``fn`` (a ``torch.fft`` transform along ``dim``, an axis or, for ``rfftn``, axes) that also accepts a rank's empty share of the mesh.

    FFT libraries reject empty batches; an empty result is built instead, still
    attached to ``x``'s graph so that this rank takes part in the backward
    transposes like every other rank.
    """
    if x.numel():
        return fn(x, dim=dim, norm=norm) if n is None else fn(x, n=n, dim=dim, norm=norm)
    shape = list(x.shape)
    if fn in (torch.fft.rfft, torch.fft.rfftn):
        last = dim if isinstance(dim, int) else dim[-1]
        shape[last] = shape[last] // 2 + 1
    elif fn is torch.fft.irfft:
        shape[dim] = n
    real = x.real.dtype if x.is_complex() else x.dtype
    dtype = real if fn is torch.fft.irfft else (torch.complex128 if real == torch.float64 else torch.complex64)
    anchor = 0 * x.sum()
    return torch.zeros(shape, dtype=dtype, device=x.device) + (anchor if dtype.is_complex else anchor.real)


def _redistributed(x: torch.Tensor, comm: Comm, split_axis: int, split_sizes: list[int], gather_axis: int, gather_sizes: list[int]):
    """:func:`_transpose` without autograd: each piece copied out of ``x`` and into the result once."""
    me = comm.rank
    real = torch.view_as_real(x)
    split_axis, gather_axis = split_axis + x.dim() - 3, gather_axis + x.dim() - 3  # after any batch axes
    shape = list(real.shape)
    shape[split_axis], shape[gather_axis] = split_sizes[me], sum(gather_sizes)
    out = real.new_empty(shape)
    comm.all_to_all_into(list(torch.split(real, split_sizes, dim=split_axis)), list(torch.split(out, gather_sizes, dim=gather_axis)))
    return torch.view_as_complex(out)


class Transpose(torch.autograd.Function):
    """Differentiable :func:`_transpose`: its backward is the reverse transpose (a permutation's adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, split_axis: int, split_sizes: list[int], gather_axis: int, gather_sizes: list[int]):
        ctx.args = (comm, gather_axis, gather_sizes, split_axis, split_sizes)
        return _redistributed(x, comm, split_axis, split_sizes, gather_axis, gather_sizes)

    @staticmethod
    def backward(ctx, grad):
        return _redistributed(grad.contiguous(), *ctx.args), None, None, None, None, None


def _transpose(x: torch.Tensor, comm: Comm, split_axis: int, split_sizes: list[int], gather_axis: int, gather_sizes: list[int]):
    """Redistribute a complex block among the ranks of ``comm`` with one all-to-all.

    The axes count from the first of ``x``'s last three (leading axes are a
    batch of meshes, moved together). ``x`` holds all of ``split_axis`` and this rank's piece of ``gather_axis``.
    Piece ``t`` of ``split_axis`` (``split_sizes[t]``) goes to rank ``t``; the
    pieces received are joined along ``gather_axis`` in rank order (rank ``s``
    held ``gather_sizes[s]``). The result holds all of ``gather_axis`` and this
    rank's piece of ``split_axis``. Each piece is copied straight from its
    place in ``x`` into the message and from the message into its place in
    the result (:meth:`~halopipe.distributed.comm.Comm.all_to_all_into`).
    """
    if comm.size == 1:
        return x
    return Transpose.apply(x, comm, split_axis, split_sizes, gather_axis, gather_sizes)


# ------------------------------------------------------------------ process grid
def _grid_pieces(sizes, grid) -> dict[str, list[int]]:
    """The pieces of each axis a ``grid`` splits: x0 and k1 over its rows, x1 and k2 over its columns."""
    n0, n1, n2 = sizes
    rows, columns = grid
    return {
        "x0": balanced_split(n0, rows),
        "x1": balanced_split(n1, columns),
        "k2": balanced_split(n2 // 2 + 1, columns),
        "k1": balanced_split(n1, rows),
    }


def grid_cost(sizes, grid) -> dict[str, int]:
    """What one forward transform costs the busiest rank of a ``grid = (Pr, Pc)`` on a mesh of ``sizes``.

    Returns ``held`` (bytes of the largest block a rank holds at any stage,
    float64), ``messages`` and ``bytes`` (sent to other ranks in the two
    transposes) and ``modelled`` (``messages * MESSAGE_COST_BYTES + bytes``),
    each the largest over ranks. The inverse costs the same.
    """
    n0, n1, n2 = (int(s) for s in sizes)
    h = n2 // 2 + 1
    rows, columns = grid
    pieces = _grid_pieces((n0, n1, n2), grid)
    x0, x1, k2, k1 = pieces["x0"], pieces["x1"], pieces["k2"], pieces["k1"]
    worst = {"held": 0, "messages": 0, "bytes": 0, "modelled": 0}
    for i in range(rows):
        for j in range(columns):
            held = max(x0[i] * x1[j] * n2 * 8, _COMPLEX_BYTES * max(x0[i] * x1[j] * h, x0[i] * n1 * k2[j], n0 * k1[i] * k2[j]))
            row_sends = [x0[i] * x1[j] * k2[t] for t in range(columns) if t != j]
            column_sends = [x0[i] * k1[t] * k2[j] for t in range(rows) if t != i]
            sends = row_sends + column_sends
            messages = sum(1 for s in sends if s)
            sent = _COMPLEX_BYTES * sum(sends)
            for key, value in zip(worst, (held, messages, sent, messages * MESSAGE_COST_BYTES + sent)):
                worst[key] = max(worst[key], value)
    return worst


def _full(sizes, grid) -> bool:
    """Whether every rank of ``grid`` holds part of the mesh at every stage."""
    n0, n1, n2 = (int(s) for s in sizes)
    return grid[0] <= min(n0, n1) and grid[1] <= min(n1, n2 // 2 + 1)


def choose_grid(sizes, parts: int, decomposition: str = "auto") -> tuple[int, int]:
    """The process grid ``(Pr, Pc)`` for ``parts`` ranks on a mesh of ``sizes`` (see the module docstring).

    ``decomposition``: ``"auto"`` (any grid), ``"slab"`` (``(parts, 1)``) or
    ``"pencil"`` (two-dimensional grids, ``Pr > 1`` and ``Pc > 1``; for a prime
    ``parts``, ``(1, parts)``; the slab when ``parts`` is 1).
    """
    if decomposition not in DECOMPOSITIONS:
        raise ValueError(f"mesh decomposition must be one of {DECOMPOSITIONS}, got {decomposition!r}")
    grids = [(rows, parts // rows) for rows in range(1, parts + 1) if parts % rows == 0]
    if decomposition == "slab" or parts == 1:
        return (parts, 1)
    if decomposition == "pencil":
        grids = [g for g in grids if g[0] > 1 and g[1] > 1] or [(1, parts)]
    costs = {g: grid_cost(sizes, g) for g in grids}
    full = [g for g in grids if _full(sizes, g)]
    if full:
        return min(full, key=lambda g: (costs[g]["modelled"], g[1]))
    return min(grids, key=lambda g: (costs[g]["held"], costs[g]["modelled"], g[1]))


def distributed_mesh_transform(comm: Comm, sizes, decomposition: str = "auto") -> PencilMeshTransform:
    """The FFT of a mesh of ``sizes`` shared by the ranks of ``comm``, on the grid :func:`choose_grid` picks."""
    sizes = tuple(int(s) for s in sizes)
    grid = choose_grid(sizes, comm.size, decomposition)
    return SlabMeshTransform(comm, sizes) if grid[1] == 1 else PencilMeshTransform(comm, sizes, grid)


# ------------------------------------------------------------------ transform
class PencilMeshTransform(MeshTransform):
    """The mesh transform of :mod:`halopipe.meshfft` on a ``Pr x Pc`` grid of the ranks of ``comm``.

    Parameters
    ----------
    comm : the ranks sharing the mesh; rank ``r`` is grid point ``divmod(r, Pc)``.
    sizes : ``(n0, n1, n2)`` mesh points.
    grid : ``(Pr, Pc)`` with ``Pr * Pc == comm.size``.

    Real space: this rank's block ``x0 in [a0, b0)``, ``x1 in [a1, b1)`` as
    ``(b0 - a0, b1 - a1, n2)``. Spectrum: ``k1 in [c1, d1)``, ``k2 in [c2,
    d2)`` as ``(n0, d1 - c1, d2 - c2)``. The row and column sub-communicators
    are split off ``comm`` at the first transform (collectively, like the
    transform itself).
    """

    def __init__(self, comm: Comm, sizes, grid: tuple[int, int]) -> None:
        self.comm = comm
        self.sizes = tuple(int(s) for s in sizes)
        self.grid = (int(grid[0]), int(grid[1]))
        if len(self.sizes) != 3 or min(self.sizes) < 1:
            raise ValueError(f"{type(self).__name__}: sizes must be three positive integers, got {sizes}")
        if self.grid[0] < 1 or self.grid[1] < 1 or self.grid[0] * self.grid[1] != comm.size:
            raise ValueError(f"{type(self).__name__}: grid {grid} must be two positive factors of the {comm.size} ranks")
        self.parts = comm.size
        self.pieces = _grid_pieces(self.sizes, self.grid)
        self.grid_rank = divmod(comm.rank, self.grid[1])
        i, j = self.grid_rank
        self.own_planes = self._own("x0", i)
        self.own_columns = self._own("x1", j)
        self.own_rows = self._own("k1", i)
        self.own_k2 = self._own("k2", j)
        self._comms: tuple[Comm, Comm] | None = None
        self._boxmaps: list[BlockBoxMap] = []  # newest first; the same list on every rank

    def _own(self, axis: str, index: int) -> tuple[int, int]:
        start = _starts(self.pieces[axis])[index]
        return start, start + self.pieces[axis][index]

    def _row_and_column(self) -> tuple[Comm, Comm]:
        """The ranks of this rank's grid row (same ``x0`` piece) and grid column (same ``x1`` piece)."""
        if self._comms is None:
            rows, columns = self.grid
            self._comms = (
                self.comm.split([[i * columns + j for j in range(columns)] for i in range(rows)]),
                self.comm.split([[i * columns + j for i in range(rows)] for j in range(columns)]),
            )
        return self._comms

    def real_shape(self) -> tuple[int, int, int]:
        """Shape of this rank's real-space block."""
        return (self.own_planes[1] - self.own_planes[0], self.own_columns[1] - self.own_columns[0], self.sizes[2])

    # ----------------------------------------------------------- interface
    def forward(self, mesh: torch.Tensor) -> torch.Tensor:
        self._check_block(mesh)
        row, column = self._row_and_column()
        p = self.pieces
        x = _fft(torch.fft.rfft, mesh, dim=-1, norm="backward")
        x = _fft(torch.fft.fft, _transpose(x, row, 2, p["k2"], 1, p["x1"]), dim=-2, norm="backward")
        return _fft(torch.fft.fft, _transpose(x, column, 1, p["k1"], 0, p["x0"]), dim=-3, norm="backward")

    def _check_block(self, mesh: torch.Tensor) -> None:
        if tuple(mesh.shape[-3:]) != self.real_shape():
            name, shape = type(self).__name__, self.real_shape()
            raise ValueError(f"{name}.forward: this rank's block must have shape (..., *{shape}), got {tuple(mesh.shape)}")

    def inverse(self, spectrum: torch.Tensor) -> torch.Tensor:
        row, column = self._row_and_column()
        p = self.pieces
        x = _transpose(_fft(torch.fft.ifft, spectrum, dim=-3, norm="forward"), column, 0, p["x0"], 1, p["k1"])
        x = _transpose(_fft(torch.fft.ifft, x, dim=-2, norm="forward"), row, 1, p["x1"], 2, p["k2"])
        return _fft(torch.fft.irfft, x, n=self.sizes[2], dim=-1, norm="forward")

    def frequencies(self, device=None):
        (c1, d1), (c2, d2) = self.own_rows, self.own_k2
        m0 = signed_frequencies(self.sizes[0], device)[:, None, None]
        m1 = signed_frequencies(self.sizes[1], device)[c1:d1][None, :, None]
        m2 = torch.arange(c2, d2, device=device)[None, None, :]
        return m0, m1, m2

    def scatter_full(self, mesh: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full mesh (for tests and for starting from a replicated mesh)."""
        (a0, b0), (a1, b1) = self.own_planes, self.own_columns
        return mesh[..., a0:b0, a1:b1, :]

    def boxes(self, lo, extent) -> BoxMap:
        """A box map holding ``(lo, extent)``: a cached one where it holds every rank's box, else a new padded one.

        Building a map needs every rank's box (one all-gather, O(P)); reusing one needs a vote (one all-reduce
        of a flag per cached map). Boxes are padded by ``BOX_MARGIN`` points per side, so the map survives the
        atoms' motion between rebuilds and most steps cost only the vote.
        """
        holds = [int(_holds(m, lo, extent, self.sizes)) for m in self._boxmaps]
        if holds and self.comm.distributed:
            holds = self.comm.all_reduce(torch.tensor(holds), op="min").tolist()
        for boxmap, everywhere in zip(self._boxmaps, holds):
            if everywhere:
                return boxmap
        boxmap = BlockBoxMap(self, *_padded(lo, extent, self.sizes))
        self._boxmaps = [boxmap, *self._boxmaps][:CACHED_BOX_MAPS]
        return boxmap


class SlabMeshTransform(PencilMeshTransform):
    """The pencil transform on the ``P x 1`` grid: slabs of ``x0`` planes, spectrum rows of ``k1``, one transpose.

    With no transpose between them, the forward's transforms along axes 2
    and 1 are one 2-D real FFT: fewer passes over the slab than two 1-D ones
    (a 30 x 60 x 60 slab on one Intel Xeon thread, medians of 400, four
    rounds: 348-562 -> 304-533 µs). The inverse's two took as long either way.
    """

    def __init__(self, comm: Comm, sizes) -> None:
        super().__init__(comm, sizes, (comm.size, 1))

    def forward(self, mesh: torch.Tensor) -> torch.Tensor:
        self._check_block(mesh)
        _, column = self._row_and_column()
        x = _fft(torch.fft.rfftn, mesh, dim=(-2, -1), norm="backward")
        return _fft(torch.fft.fft, _transpose(x, column, 1, self.pieces["k1"], 0, self.pieces["x0"]), dim=-3, norm="backward")


# ------------------------------------------------------------------ box <-> blocks
BOX_MARGIN = 1
"""Mesh points added on each side of a rank's box, so that its box map outlives small motions of the atoms."""

CACHED_BOX_MAPS = 4
"""Box maps kept per transform (several particle-mesh models may share one mesh)."""


def _padded(lo, extent, sizes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lo, extent)`` grown by ``BOX_MARGIN`` per side (an empty box stays empty; an axis never exceeds the mesh)."""
    if 0 in tuple(extent):
        return tuple(int(v) for v in lo), tuple(int(e) for e in extent)
    grown = [min(int(e) + 2 * BOX_MARGIN, n) for e, n in zip(extent, sizes)]
    return tuple(int(v) - BOX_MARGIN if g < n else 0 for v, g, n in zip(lo, grown, sizes)), tuple(grown)


def _holds(boxmap: BoxMap, lo, extent, sizes) -> bool:
    """Whether ``boxmap``'s periodic box contains the box ``(lo, extent)``."""
    if 0 in tuple(extent):
        return True
    return all(
        e_map >= n or (int(v) - v_map) % n + int(e) <= e_map for v, e, v_map, e_map, n in zip(lo, extent, boxmap.lo, boxmap.extent, sizes)
    )


def _wrapped(lo: int, extent: int, n: int) -> torch.Tensor:
    return (lo + torch.arange(extent)) % n


def _inside(points: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    return (points >= bounds[0]) & (points < bounds[1])


Run = tuple[int, int, int]
"""``(position in the message, position in the box or block, length)`` along one axis."""


def _runs(index: torch.Tensor) -> tuple[Run, ...]:
    """The maximal runs of consecutive values of the 1-D ``index``, as (position, first value, length)."""
    runs: list[list[int]] = []
    for k, v in enumerate(index.tolist()):  # mesh lines of one axis (tens), once per box map
        if runs and v == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([k, v, 1])
    return tuple(tuple(r) for r in runs)


def _composed(first: tuple[Run, ...], second: tuple[Run, ...]) -> tuple[Run, ...]:
    """Runs from ``first``'s targets to ``second``'s where both map the same message positions (``(v, w, length)``)."""
    out = []
    for k, v, n in first:
        for k2, w, n2 in second:
            lo, hi = max(k, k2), min(k + n, k2 + n2)
            if lo < hi:
                out.append((v + lo - k, w + lo - k2, hi - lo))
    return tuple(out)


def _slice_pairs(axes: tuple[tuple[Run, ...], ...]) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """For runs along each of three axes, every block of the product as (source slices, target slices)."""
    pairs = []
    for a, b, n in axes[0]:
        for c, d, m in axes[1]:
            for e, f, o in axes[2]:
                pairs.append(((slice(a, a + n), slice(c, c + m), slice(e, e + o)), (slice(b, b + n), slice(d, d + m), slice(f, f + o))))
    return pairs


def _messages(source: torch.Tensor, pairs: dict, shapes: dict) -> dict[int, torch.Tensor]:
    """Per peer, a message of ``shapes[peer]`` (after the batch axes) filled from ``source`` by its (message, source) slice pairs."""
    batch = tuple(source.shape[:-3])
    out = {}
    for peer, peer_pairs in pairs.items():
        message = source.new_empty(batch + shapes[peer])
        for into, out_of in peer_pairs:
            message[(..., *into)] = source[(..., *out_of)]
        out[peer] = message
    return out


class BlockBoxMap(BoxMap):
    """A rank's periodic box of mesh points mapped onto the ranks' blocks (see the module docstring).

    Along each axis the points a box shares with a block are at most a few
    runs of consecutive points in both (a periodic box wraps at most once), so
    the values move as slices: no index tensors, no scattered adds; this
    rank's own part goes from box to block directly.
    """

    def __init__(self, transform: PencilMeshTransform, lo, extent) -> None:
        self.t = transform
        comm, sizes = transform.comm, transform.sizes
        self.lo = tuple(int(v) for v in lo)
        self.extent = tuple(int(e) for e in extent)
        mine = tuple(int(v) for v in lo) + self.extent
        boxes = comm.all_gather_object(mine) if comm.distributed else [mine]
        columns = transform.grid[1]
        starts0, starts1 = _starts(transform.pieces["x0"]), _starts(transform.pieces["x1"])
        bounds = [
            ((starts0[i], starts0[i] + transform.pieces["x0"][i]), (starts1[j], starts1[j] + transform.pieces["x1"][j]))
            for i, j in (divmod(s, columns) for s in range(comm.size))
        ]
        # What my box sends to each block: message positions -> box positions, per axis.
        send_runs: dict[int, tuple[tuple[Run, ...], ...]] = {}
        # What each box sends to my block: message positions -> block positions, per axis.
        recv_runs: dict[int, tuple[tuple[Run, ...], ...]] = {}
        g0, g1 = _wrapped(mine[0], self.extent[0], sizes[0]), _wrapped(mine[1], self.extent[1], sizes[1])
        for s, (b0, b1) in enumerate(bounds):
            lines0, lines1 = _inside(g0, b0).nonzero()[:, 0], _inside(g1, b1).nonzero()[:, 0]
            if lines0.numel() and lines1.numel() and self.extent[2]:
                send_runs[s] = (_runs(lines0), _runs(lines1), ((0, 0, self.extent[2]),))
        (a0, _), (a1, _) = bounds[comm.rank]
        for r, box in enumerate(boxes):
            lo_r, ext_r = box[:3], box[3:]
            h0, h1 = _wrapped(lo_r[0], ext_r[0], sizes[0]), _wrapped(lo_r[1], ext_r[1], sizes[1])
            in0, in1 = h0[_inside(h0, bounds[comm.rank][0])], h1[_inside(h1, bounds[comm.rank][1])]
            if in0.numel() and in1.numel() and ext_r[2]:
                recv_runs[r] = (_runs(in0 - a0), _runs(in1 - a1), _runs(_wrapped(lo_r[2], ext_r[2], sizes[2])))
        me = comm.rank
        self.send_shapes = {s: tuple(sum(n for _, _, n in runs) for runs in axes) for s, axes in send_runs.items()}
        self.recv_shapes = {r: tuple(sum(n for _, _, n in runs) for runs in axes) for r, axes in recv_runs.items()}
        self.send_pairs = {s: _slice_pairs(axes) for s, axes in send_runs.items() if s != me}  # message <- box
        self.recv_pairs = {r: _slice_pairs(axes) for r, axes in recv_runs.items() if r != me}  # message -> block
        mine_both = me in send_runs and me in recv_runs
        self.own_pairs = (  # box -> my block, for the points my box shares with my block
            _slice_pairs(tuple(_composed(a, b) for a, b in zip(send_runs[me], recv_runs[me]))) if mine_both else []
        )

    def _scatter_sum(self, box: torch.Tensor) -> torch.Tensor:
        """Box values -> my block, each mesh point summed over all boxes holding it."""
        t, batch = self.t, tuple(box.shape[:-3])
        sends = _messages(box, self.send_pairs, self.send_shapes)
        shapes = {r: batch + shape for r, shape in self.recv_shapes.items() if r in self.recv_pairs}
        got = t.comm.exchange(sends, shapes, box.dtype, box.device)
        block = box.new_zeros(batch + t.real_shape())
        for out_of, into in self.own_pairs:
            block[(..., *into)] += box[(..., *out_of)]
        for r, pairs in self.recv_pairs.items():
            for out_of, into in pairs:
                block[(..., *into)] += got[r][(..., *out_of)]
        return block

    def _gather(self, block: torch.Tensor) -> torch.Tensor:
        """My block -> every box's values at its points (the adjoint of :meth:`_scatter_sum`)."""
        batch = tuple(block.shape[:-3])
        sends = _messages(block, self.recv_pairs, self.recv_shapes)
        shapes = {s: batch + shape for s, shape in self.send_shapes.items() if s in self.send_pairs}
        got = self.t.comm.exchange(sends, shapes, block.dtype, block.device)
        box = block.new_zeros(batch + self.extent)
        for into, out_of in self.own_pairs:
            box[(..., *into)] = block[(..., *out_of)]
        for s, pairs in self.send_pairs.items():
            for out_of, into in pairs:
                box[(..., *into)] = got[s][(..., *out_of)]
        return box

    def to_mesh(self, box: torch.Tensor) -> torch.Tensor:
        return _BoxToBlock.apply(box, self)

    def from_mesh(self, mesh: torch.Tensor) -> torch.Tensor:
        return _BlockToBox.apply(mesh, self)


class _BoxToBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box, boxmap: BlockBoxMap):
        ctx.boxmap = boxmap
        return boxmap._scatter_sum(box)

    @staticmethod
    def backward(ctx, grad):
        return ctx.boxmap._gather(grad.contiguous()), None


class _BlockToBox(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, boxmap: BlockBoxMap):
        ctx.boxmap = boxmap
        return boxmap._gather(block)

    @staticmethod
    def backward(ctx, grad):
        return ctx.boxmap._scatter_sum(grad.contiguous()), None
