"""Neighbour lists on top of vesin.

Two searches are offered. :func:`neighbor_list` is the classic periodic list
through vesin (pairs ``i, j`` and integer cell shifts ``S`` with
``r_ij = r_j + S @ cell - r_i``). :func:`owned_pairs` works on a local view,
where periodic images are already explicit ghost rows: it returns every pair
within the cutoff whose centre is an owned row; :func:`owned_half_pairs` gives
each such unordered pair once, for kernels that use Newton's third law. Only indices come from the
searches; vectors and distances are recomputed
in torch (:func:`pair_vectors`) so autograd flows through them.

A :class:`VerletList` keeps a list built at ``cutoff + skin`` and reuses it
while no atom has moved more than ``skin / 2``. :class:`PairLists` is the
same reuse for a domain's views: candidate lists per ghost plan, one search
serving every model of equal width and cutoff, narrower lists filtered from
a wider one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch
from vesin import NeighborList as _VesinNeighborList

from .kernels.backend import warp_module
from .kernels.pairs import group_by_row, launch, launch_packed, packs_in_order, rows_of_groups, warp_kernel
from .scratch import ScratchPool
from .sorting import stable_argsort

_LISTS = "_warp_lists"  # the Warp source of the pair search and the list filter

__all__ = [
    "neighbor_list",
    "owned_pairs",
    "row_centred_pairs",
    "owned_half_pairs",
    "grouped_owned_half_pairs",
    "GroupedPairs",
    "narrower_half_pairs",
    "one_holder_pairs",
    "owned_pairs_cell_list",
    "pair_vectors",
    "VerletList",
    "PairLists",
    "LIST_KINDS",
    "max_displacement",
]


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def neighbor_list(
    positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, cutoff: float, full: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs within ``cutoff`` of a periodic (or partly periodic) system.

    Returns ``i``, ``j`` (int64) and integer ``shifts`` (P, 3) such that the
    pair vector is ``positions[j] + shifts @ cell - positions[i]``. Cutoffs
    larger than the cell are supported (several images of one atom).
    """
    if cutoff <= 0:
        raise ValueError(f"neighbor_list: cutoff must be positive, got {cutoff}")
    pbc_list = [bool(p) for p in pbc.tolist()]
    box = _np(cell) if any(pbc_list) else np.zeros((3, 3))
    nl = _VesinNeighborList(cutoff=float(cutoff), full_list=full)
    i, j, s = nl.compute(points=_np(positions), box=box, periodic=pbc_list, quantities="ijS", copy=True)
    dev = positions.device
    return (
        torch.as_tensor(i.astype(np.int64), device=dev),
        torch.as_tensor(j.astype(np.int64), device=dev),
        torch.as_tensor(s.astype(np.int64), device=dev).reshape(-1, 3),
    )


class GroupedPairs:
    """A half list grouped by owned row, in the kernels' form: row ``a``'s partners are ``partners[start[a]:start[a + 1]]``.

    ``partners`` (P,) and ``start`` (``n_owned + 1``) are int32, what the
    Warp kernels read; the searches write only these (a rebuild of 1.5 M
    pairs writes 6 MB instead of a 24 MB ``(2, P)`` int64 list). The
    ``(2, P)`` int64 pairs, owned row first, are made on first use
    (:attr:`pairs`) and kept, so models that index with them pay once per
    rebuild, and models that read the int32 form never do.
    """

    def __init__(self, partners: torch.Tensor, start: torch.Tensor) -> None:
        self.partners = partners
        self.start = start

    @staticmethod
    def empty(n_owned: int, device: torch.device | str) -> GroupedPairs:
        """No pairs for ``n_owned`` rows."""
        return GroupedPairs(torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(n_owned + 1, dtype=torch.int32, device=device))

    @staticmethod
    def from_pairs(pairs: torch.Tensor, n_owned: int) -> GroupedPairs:
        """Group a half list ``(2, P)`` (owned end first) by owned row; a stable sort keeps each row's order."""
        first, second, start = group_by_row(pairs[0], pairs[1], n_owned)
        grouped = GroupedPairs(second.to(torch.int32), start)
        grouped.__dict__["pairs"] = torch.stack([first, second]).to(torch.int64)  # made already: not remade from the int32 form
        return grouped

    @property
    def n_owned(self) -> int:
        return int(self.start.numel()) - 1

    @property
    def n_pairs(self) -> int:
        return int(self.partners.numel())

    @functools.cached_property
    def pairs(self) -> torch.Tensor:
        """``(2, P)`` int64: the owned row of each pair, then its partner."""
        return torch.stack([rows_of_groups(self.start, torch.int64), self.partners.long()])


def owned_pairs(rows: torch.Tensor, n_owned: int, cutoff: float) -> torch.Tensor:
    """Directed pairs ``(i, j)`` within ``cutoff`` of rows, with ``i < n_owned``.

    ``rows`` are explicit coordinates (owned rows first, then ghost images), so
    the search is non-periodic. It is :func:`owned_half_pairs` with each
    owned-owned pair in both directions, sorted by centre.
    """
    if rows.shape[0] < 2 or n_owned == 0:
        return torch.zeros(2, 0, dtype=torch.int64, device=rows.device)
    if warp_kernel("owned_half_fill", _LISTS) is None and rows.shape[0] > 8 * n_owned:
        return owned_pairs_cell_list(rows, n_owned, cutoff)
    half = owned_half_pairs(rows, n_owned, cutoff)
    i = torch.cat([half[0], half[1]])
    j = torch.cat([half[1], half[0]])
    owned = i < n_owned  # an owned-ghost pair is kept in one direction only
    i, j = i[owned], j[owned]
    order = torch.argsort(i * rows.shape[0] + j)  # deterministic order, grouped by centre
    return torch.stack([i[order], j[order]])


def owned_half_pairs(rows: torch.Tensor, n_owned: int, cutoff: float) -> torch.Tensor:
    """Each unordered pair within ``cutoff`` with at least one owned row, once, owned row first.

    Owned-owned pairs appear once (not twice as in :func:`owned_pairs`), which
    is what Newton's-third-law kernels want. With Warp the search is an
    owned-centred cell list (:func:`_warp_owned_half_pairs`, grouped by the
    owned row); without it, vesin over all rows (which also pays for
    ghost-ghost pairs), or the torch cell list when the halo is wide.
    """
    return grouped_owned_half_pairs(rows, n_owned, cutoff).pairs


def grouped_owned_half_pairs(
    rows: torch.Tensor,
    n_owned: int,
    cutoff: float,
    pool: ScratchPool | None = None,
    keys: torch.Tensor | None = None,
    capacity: int | None = None,
) -> GroupedPairs:
    """:func:`owned_half_pairs` grouped by owned row (:class:`GroupedPairs`), in a deterministic order.

    ``pool``: where the Warp search takes its per-row slots from and gives
    them back (tens of MB, reused from rebuild to rebuild instead of faulted
    in afresh). ``keys``: the rows' holder keys, to search the one-holder
    list (:func:`one_holder_pairs`) directly: with Warp each owned row scans
    only the ghosts it keeps, so the whole half list is never made. ``capacity``: the
    Warp search's slots per owned row (default :func:`_slot_capacity`, from
    the rows' density); the list is the same whatever it is.
    """
    if not 0 <= n_owned <= rows.shape[0]:  # the owned rows are a prefix of the rows: the kernels read every owned row
        raise ValueError(f"owned-centred pair search: n_owned={n_owned} must be between 0 and the {rows.shape[0]} rows")
    if rows.shape[0] < 2 or n_owned == 0:
        return GroupedPairs.empty(n_owned, rows.device)
    if warp_kernel("owned_half_fill", _LISTS) is not None:
        return _warp_owned_half_pairs(rows, n_owned, cutoff, pool, keys, capacity)
    if keys is not None:
        return one_holder_pairs(grouped_owned_half_pairs(rows, n_owned, cutoff), keys)
    if rows.shape[0] > 8 * n_owned:  # wide halo (D3): skip ghost-ghost pairs
        i, j = owned_pairs_cell_list(rows, n_owned, cutoff)
        keep = (j >= n_owned) | (i < j)
        return GroupedPairs.from_pairs(torch.stack([i[keep], j[keep]]), n_owned)
    nl = _VesinNeighborList(cutoff=float(cutoff), full_list=False)
    a, b = nl.compute(points=_np(rows), box=np.zeros((3, 3)), periodic=False, quantities="ij", copy=True)
    a = torch.as_tensor(a.astype(np.int64), device=rows.device)
    b = torch.as_tensor(b.astype(np.int64), device=rows.device)
    keep = (a < n_owned) | (b < n_owned)
    a, b = a[keep], b[keep]
    a_first = a < n_owned
    return GroupedPairs.from_pairs(torch.stack([torch.where(a_first, a, b), torch.where(a_first, b, a)]), n_owned)


def narrower_half_pairs(wider: GroupedPairs, rows: torch.Tensor, cutoff: float) -> GroupedPairs:
    """The pairs of a wider half list that a narrower view keeps: partner among ``rows``, length within ``cutoff``.

    ``wider`` is a half list of the same plan over more rows (``rows`` is a
    prefix of its rows: ghosts are in band order) at a cutoff of at least
    ``cutoff``; the result is exactly the list a fresh search over ``rows`` at
    ``cutoff`` finds, in the wider list's order. With Warp, one thread per
    owned row counts and then writes its kept partners; otherwise a torch mask.
    """
    if wider.n_pairs > 0 and warp_kernel("half_list_fill", _LISTS) is not None:
        pos = rows.detach().to(torch.float64).contiguous()
        return _filtered("half_list", wider, rows.device, [pos, wider.start, wider.partners, rows.shape[0], float(cutoff) ** 2])
    pairs = wider.pairs[:, wider.pairs[1] < rows.shape[0]]
    d = rows[pairs[1]] - rows[pairs[0]]
    return GroupedPairs.from_pairs(pairs[:, (d * d).sum(dim=1) <= cutoff * cutoff], wider.n_owned)


def one_holder_pairs(half: GroupedPairs, keys: torch.Tensor) -> GroupedPairs:
    """The pairs of a half list that this view evaluates when every pair of the system is evaluated once (``newton on``).

    A pair with a ghost is in the half lists of every view that holds one
    of its ends (two ranks, or both ends' rows on one rank through a
    periodic image). ``keys`` (R,) int64, ``4 id`` plus two low bits per row
    (:meth:`~halopipe.domain.Domain.holder_keys`), decide which holder keeps
    it: owned-owned pairs are kept; a pair ``(a, b)`` with a
    ghost ``b`` that is a periodic image of an atom owned here is kept when
    ``b``'s shift is positive (of the two pairs ``(a, c + t)`` and
    ``(c, a - t)`` one, so the search can leave the negative images out); a
    pair with a ghost owned elsewhere is kept when ``a``'s hashed id bit
    differs from ``b``'s class (its bit, flipped when this rank's number is
    below its owner's), which the owner sees flipped, so it keeps exactly
    the others and a face's pairs split about evenly between its two ranks
    (so the search scans one class of ghosts per owned row). Every rank
    decides alike from ids, ranks and integer shifts. The kept pairs stay
    grouped by owned row, in the list's order.
    """
    keys = keys.contiguous()
    n_owned = half.n_owned
    if half.n_pairs > 0 and warp_kernel("one_holder_fill", _LISTS) is not None:
        return _filtered("one_holder", half, keys.device, [half.start, half.partners, keys, n_owned])
    first, second = half.pairs
    low = keys[second] & 3
    keeps = torch.where((low & 1) == 1, low == 3, (low >> 1) != ((keys[first] >> 1) & 1))
    return GroupedPairs.from_pairs(half.pairs[:, (second < n_owned) | keeps], n_owned)


def _warp_owned_half_pairs(
    rows: torch.Tensor, n_owned: int, cutoff: float, pool: ScratchPool | None, keys: torch.Tensor | None = None, capacity: int | None = None
) -> GroupedPairs:
    """Owned-centred half pairs by a cell list in Warp: cost proportional to the owned rows.

    Rows are binned into cubes (:func:`_cube_edge`) sliced along x
    (:data:`X_SLICES_PER_CUTOFF`) and sorted by cell, owned rows and ghost
    rows in two sections; each owned row ``i`` scans the cubes
    within ``cutoff`` (3 x 3 or 5 x 5 lines of contiguous cubes, each trimmed
    to the cutoff sphere) for ghosts, and their upper half for owned rows
    (each owned pair once, from the end that sorts first). Pairs come out
    grouped by ``i`` in a deterministic order. With ``keys``, only the pairs
    this holder keeps (the ``owned_once`` kernels; the ghosts it can never
    keep are left out of the cells).
    """
    device = rows.device
    pos = rows.detach().to(torch.float64).contiguous()
    lo, hi = _column_bounds(pos)
    extent = (hi - lo).tolist()
    edge = _cube_edge(float(cutoff), pos.shape[0] / max(math.prod(max(e, float(cutoff)) for e in extent), 1e-30))
    split = max(round(X_SLICES_PER_CUTOFF * edge / float(cutoff)), 1)  # x slices per cube
    while math.prod(int(e / edge) + 1 for e in extent) * split > 8 * pos.shape[0] + 4096:  # sparse rows: coarser cubes
        edge *= 2.0
    edge_x = edge / split
    reach, reach_x = math.ceil(float(cutoff) / edge), math.ceil(float(cutoff) / edge_x)
    assert reach <= 2  # cubes of at least half the cutoff: the Warp search holds a row's (2 r + 1)^2 lines' ranges in a fixed vector
    scale = torch.tensor([edge_x, edge, edge], dtype=pos.dtype, device=device)
    cell = (pos - lo).div_(scale).floor_().to(torch.int32)
    dims = [int(d) + 1 for d in ((hi - lo) / scale).floor_().tolist()]  # the last cell: the same arithmetic as the rows at hi
    n_cells = math.prod(dims)
    cell_id = (cell[:, 2].long() * dims[1] + cell[:, 1]) * dims[0] + cell[:, 0]
    if keys is None:
        cell_id[n_owned:] += n_cells  # ghosts in a section of their own, after the owned rows
        sections, order = 2, stable_argsort(cell_id)
    else:
        cell_id, row_of = _ghost_class_cells(cell_id, keys, n_owned, n_cells)
        sections, order = 3, row_of.index_select(0, stable_argsort(cell_id))
    # owned rows sort first (their cells come first): slot[i] is owned row i's sorted position
    slot = torch.empty(n_owned, dtype=torch.int32, device=device).index_copy_(
        0, order[:n_owned], torch.arange(n_owned, dtype=torch.int32, device=device)
    )
    cell_start = torch.zeros(sections * n_cells + 1, dtype=torch.int32, device=device)
    cell_start[1:] = torch.cumsum(torch.bincount(cell_id, minlength=sections * n_cells)[: sections * n_cells], 0)
    wp = warp_module()
    trim_reach = float(cutoff) * (1.0 + 1e-9) + 1e-9  # trims lines with a margin far above rounding; the pair test is exact
    order = order.to(torch.int32)
    sorted_rows = pos.index_select(0, order)  # half the time of pos[order] on the CPU
    grid = [pos, sorted_rows, order, slot, cell.contiguous(), cell_start, wp.vec3i(*dims), wp.vec3d(*lo.tolist()), edge, edge_x]
    capacity = capacity or _slot_capacity(cell, dims, split, float(cutoff) / edge)
    kernels = "owned_half" if keys is None else "owned_once"
    keys = torch.empty(0, dtype=torch.int64, device=device) if keys is None else keys.contiguous()
    inputs = [*grid, reach, reach_x, trim_reach, float(cutoff) ** 2, keys]
    if n_owned * capacity * 4 > PAIR_SLOT_BYTES or n_owned * capacity >= 2**31:
        return _grouped_two_passes(kernels, n_owned, device, [*inputs, 0])
    return _owned_half_one_pass(kernels, n_owned, device, inputs, order, capacity, pool or ScratchPool())


def _column_bounds(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column's least and greatest value of ``(N, 3)`` ``x``: column by column, 3x faster than over dim 0 on the CPU."""
    bounds = [torch.aminmax(x[:, a]) for a in range(3)]
    return torch.stack([b.min for b in bounds]), torch.stack([b.max for b in bounds])


def _ghost_class_cells(cell_id: torch.Tensor, keys: torch.Tensor, n_owned: int, n_cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-holder search's cell of each row and its row: owned rows, then the ghosts of class 0, then of class 1.

    A ghost owned elsewhere goes to its class's section (``keys``' low bits
    0 or 2, :func:`one_holder_pairs`); an image of an owned atom with a
    positive shift (3), kept by every row, to both, so it appears twice;
    one with a negative shift (1), kept by none, past every cell: never
    scanned. ``cell_id``: each row's cell within a section.
    """
    low = keys[n_owned:] & 3
    ghost = cell_id[n_owned:] + (1 + torch.where((low & 1) == 0, low >> 1, 0)) * n_cells
    ghost.masked_fill_(low == 1, 3 * n_cells)
    positive = torch.nonzero(low == 3)[:, 0]
    rows = torch.arange(cell_id.numel(), device=cell_id.device)
    cells = torch.cat([cell_id[:n_owned], ghost, ghost.index_select(0, positive) + n_cells])
    return cells, torch.cat([rows, positive + n_owned])


SPHERE_ROWS_FOR_HALF_CUBES = 350
"""Rows in a cutoff sphere above which the search bins by cubes of half the cutoff rather than the cutoff (:func:`_cube_edge`)."""


def _cube_edge(cutoff: float, density: float) -> float:
    """The search's cube edge: a hair over the cutoff, or over half of it where a cutoff sphere holds many rows.

    A row scans (2 r + 1)^2 lines of cubes (r = 1 or 2 cubes of reach), each
    costing a set-up (its trim to the sphere) besides its rows (~2.5 ns each
    on one AMD EPYC thread); cubes of edge ``cutoff`` scan 9 lines of about 9
    rho rc^3 rows in all, cubes of ``cutoff / 2`` 25 lines of 6.25 rho rc^3.
    Measured on the one-pass search with its ``while`` loop over candidates
    (cheaper rows shift the balance to fewer lines), one AMD EPYC thread, the
    demo's NaCl of 8,000 owned rows: cubes of the cutoff take 11-15 % less at
    11 Å (~250 rows a sphere: the one-holder list 12.6 -> 10.7 ms) and 4-8 %
    less at 12 Å (~320); at 13 Å (~410) it depends on the list; half cubes take
    4-8 % less at 15 Å (~630) and 9-13 % at 21 Å (~1,700). Lennard-Jones argon
    at 9.5 Å (~100 rows): half cubes 38-41 % slower. Re-checked once the
    search worked out a row's line ranges before scanning them (cheaper
    lines): half cubes 18-23 % slower on LJ, even at 11 Å, 3-41 % faster at
    13 Å, 11-15 % at 15 Å; the crossover stays. The hair keeps the reach
    at 1 or 2 cubes whatever the rounding of the binning.
    """
    sphere_rows = density * 4.0 / 3.0 * math.pi * cutoff**3
    return cutoff * ((0.5 if sphere_rows > SPHERE_ROWS_FOR_HALF_CUBES else 1.0) + 1e-9)


X_SLICES_PER_CUTOFF = 8
"""The search's cells are cubes sliced along x, about this many slices per cutoff (:func:`_warp_owned_half_pairs`).

A row scans each line of cells it reaches from the first slice the cutoff
sphere touches to the last; thin slices trim that scan close to the
sphere's chord at no extra line set-up (a line's slices are contiguous
in the sorted rows). Lennard-Jones argon 32k, cubes of the cutoff: the
search kernel 20.8 ms a rebuild whole, 17.9 in two slices, 16.7 in four,
15.6 in eight. Eight once cost the packing more than that, while the slots
were sized from the slices' density; sized from the last search they are
not, and on two ranks the kernel went from 8.6-9.2 to 8.0-8.6 ms a rebuild
per rank (NaCl 4k's half cubes: the same 2.5-2.7 ms).
"""


PAIR_SLOT_BYTES = 512 << 20
"""Memory the one-pass search may fill with its rows' slots (:func:`_slot_capacity` partners each, 4 bytes a partner)."""


def _slot_capacity(cell: torch.Tensor, dims: list[int], split: int, reach_in_cubes: float) -> int:
    """Partner slots per owned row: 1.3x the partners a row has in a full sphere of the reach, at its cubes' density, + 16.

    The density is that of the occupied cubes (so vacuum around a slab or a
    molecule does not dilute it), counted on whole cubes (``split`` x slices
    each: thin slices, mostly empty or nearly so, would overstate it); a row
    takes about half of the sphere's partners (the other half find it), so
    the slots hold about 2.6x a row's share, and a denser spot than that
    sends the search to two passes.
    """
    c = cell.long()
    cube = (c[:, 2] * dims[1] + c[:, 1]) * ((dims[0] + split - 1) // split) + c[:, 0] // split
    occupancy = torch.bincount(cube)  # rows of each cube, owned and ghost
    occupied = occupancy[occupancy > 0]
    per_cube = float(occupied.float().mean()) if occupied.numel() else 0.0
    return int(1.3 * per_cube * (4.0 / 3.0) * math.pi * reach_in_cubes**3) + 16


def _owned_half_one_pass(
    kernels: str, n_owned: int, device: torch.device, inputs: list, order: torch.Tensor, capacity: int, pool: ScratchPool
) -> GroupedPairs:
    """The owned-centred search in one pass over ``capacity`` slots per row, packed by a copy; two passes if a row overflows.

    The slots hold sorted positions; the copy maps them to rows through ``order``.
    On the CPU the search writes the list packed instead (:func:`_owned_half_packed`).
    """
    if packs_in_order(device):
        return _owned_half_packed(kernels, n_owned, device, inputs, capacity, pool)
    counts = torch.empty(n_owned, dtype=torch.int32, device=device)
    slots = pool.take_flat(n_owned * capacity, torch.int32, device)
    nothing = torch.empty(0, dtype=torch.int32, device=device)
    launch(warp_kernel(f"{kernels}_slots", _LISTS), n_owned, device, [*inputs, capacity, nothing], [slots, counts])
    start = torch.zeros(n_owned + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=start[1:])
    partners = torch.empty(int(start[-1]), dtype=torch.int32, device=device)
    if int(counts.max()) <= capacity:
        launch(warp_kernel("compact_slots", _LISTS), n_owned, device, [slots, order, capacity, start], [partners])
    else:  # a row outgrew its slots: the counts are known, so one more pass writes the pairs
        launch(warp_kernel(f"{kernels}_fill", _LISTS), n_owned, device, [*inputs, 0, start], [partners, nothing])
    pool.give_flat(slots)
    return GroupedPairs(partners, start)


def _owned_half_packed(kernels: str, n_owned: int, device: torch.device, inputs: list, capacity: int, pool: ScratchPool) -> GroupedPairs:
    """The owned-centred search on the CPU, written packed in one pass (``PACKED``: rows run in order) into a buffer the list keeps.

    The buffer holds ``capacity`` partners a row on average, the slots' size
    on a GPU; should the rows' pairs outnumber it, their starts are still
    right, so one more pass (``FILL``) writes them. ``pool`` lends the buffer
    (:meth:`~halopipe.scratch.ScratchPool.lend_flat`): the list is a view of
    it, and once the list is gone a later search writes there again. A copy
    out into a fresh list cost LJ 32k 1.8 ms a rebuild on one AMD EPYC
    thread, mostly its pages faulting.
    """
    budget = n_owned * capacity
    buffer = pool.lend_flat(budget, torch.int32, device)
    start, total = launch_packed(warp_kernel(f"{kernels}_packed", _LISTS), n_owned, device, [*inputs, budget], [buffer])
    if total <= budget:
        return GroupedPairs(buffer[:total], start)
    partners = torch.empty(total, dtype=torch.int32, device=device)
    launch(warp_kernel(f"{kernels}_fill", _LISTS), n_owned, device, [*inputs, 0, start], [partners, start[:0]])
    return GroupedPairs(partners, start)


def _filtered(kernels: str, listed: GroupedPairs, device: torch.device, inputs: list) -> GroupedPairs:
    """The pairs of ``listed`` that the Warp filter ``kernels`` keeps, in one pass written into ``listed``'s layout, then packed.

    A row keeps at most the pairs it has in ``listed``, so its range there
    holds them; the packing copies only the kept ones. Measured on the demo
    composite's Lennard-Jones list (274,000 of 494,000 pairs kept, 2 ranks):
    1.8-2.1 ms a rebuild, against 2.6 ms in two passes (a count, then the
    writes, each testing every pair). Where that layout would not fit in
    :data:`PAIR_SLOT_BYTES`, two passes. On the CPU the kept pairs are
    written packed in the one pass (``PACKED``: rows run in order), then
    copied out where they fill less than half of the buffer.
    """
    n_owned = listed.n_owned
    if listed.n_pairs * 4 > PAIR_SLOT_BYTES:
        return _grouped_two_passes(kernels, n_owned, device, inputs)
    if packs_in_order(device):
        kept = torch.empty(listed.n_pairs, dtype=torch.int32, device=device)  # a row keeps at most its pairs: always fits
        start, total = launch_packed(warp_kernel(f"{kernels}_packed", _LISTS), n_owned, device, inputs, [kept])
        return GroupedPairs(kept[:total].clone() if 2 * total < listed.n_pairs else kept[:total], start)
    counts = torch.empty(n_owned, dtype=torch.int32, device=device)
    slots = torch.empty(listed.n_pairs, dtype=torch.int32, device=device)
    nothing = torch.empty(0, dtype=torch.int32, device=device)
    launch(warp_kernel(f"{kernels}_slots", _LISTS), n_owned, device, [*inputs, nothing], [slots, counts])
    start = torch.zeros(n_owned + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=start[1:])
    partners = torch.empty(int(start[-1]), dtype=torch.int32, device=device)
    launch(warp_kernel("compact_runs", _LISTS), n_owned, device, [slots, listed.start, start], [partners])
    return GroupedPairs(partners, start)


def _grouped_two_passes(kernels: str, n_owned: int, device: torch.device, inputs: list) -> GroupedPairs:
    """Run the Warp pair of kernels ``{kernels}_count`` and ``{kernels}_fill`` over the owned rows.

    The first counts each row's pairs, a prefix sum makes the offsets, the
    second writes the partners, grouped by owned row.
    """
    counts = torch.empty(n_owned, dtype=torch.int32, device=device)
    nothing = torch.empty(0, dtype=torch.int32, device=device)
    launch(warp_kernel(f"{kernels}_count", _LISTS), n_owned, device, [*inputs, nothing], [nothing, counts])
    start = torch.zeros(n_owned + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=start[1:])
    partners = torch.empty(int(start[-1]), dtype=torch.int32, device=device)
    launch(warp_kernel(f"{kernels}_fill", _LISTS), n_owned, device, [*inputs, start], [partners, nothing])
    return GroupedPairs(partners, start)


def row_centred_pairs(rows: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs within ``cutoff`` with every row as a centre, and their vectors (differentiable in ``rows``).

    Message-passing models in a wide halo use it: ghost rows then get (partial)
    features of their own, whose errors never reach owned rows.
    """
    pairs = owned_pairs(rows.detach(), rows.shape[0], cutoff)
    vectors, _ = pair_vectors(rows, pairs)
    return pairs, vectors


def owned_pairs_cell_list(rows: torch.Tensor, n_owned: int, cutoff: float, max_candidates: int = 1 << 24) -> torch.Tensor:
    """Owned-centred pair search with a torch cell list (any device).

    Every row is binned into cubes of edge ``cutoff``; each owned row scans its
    27 neighbouring cubes, so the cost is proportional to the owned atoms and
    their neighbourhoods, never to ghost-ghost pairs. Owned centres are
    processed in chunks of at most ``max_candidates`` candidate pairs to bound
    memory.
    """
    device = rows.device
    n_rows = rows.shape[0]
    empty = torch.zeros(2, 0, dtype=torch.int64, device=device)
    if n_rows < 2 or n_owned == 0:
        return empty
    pos = rows.detach().to(torch.float64)
    lo = pos.min(dim=0).values
    edge = float(cutoff)
    cell3 = torch.floor((pos - lo) / edge).to(torch.int64)
    dims = cell3.max(dim=0).values + 1
    strides = torch.stack([dims[1] * dims[2], dims[2], torch.ones_like(dims[2])])
    cell_id = cell3 @ strides
    order = torch.argsort(cell_id, stable=True)
    counts = torch.bincount(cell_id, minlength=int(dims.prod()))
    starts = torch.cumsum(counts, 0) - counts
    offsets = torch.stack(torch.meshgrid(*[torch.arange(-1, 2, device=device)] * 3, indexing="ij"), dim=-1).reshape(27, 3)
    per_atom = int(counts.max()) * 27
    chunk = max(1, max_candidates // max(per_atom, 1))
    pieces = []
    for first in range(0, n_owned, chunk):  # loop over chunks of atoms, not atoms
        centres = torch.arange(first, min(first + chunk, n_owned), device=device)
        neighbour = cell3[centres, None, :] + offsets[None, :, :]
        inside = ((neighbour >= 0) & (neighbour < dims)).all(dim=2)
        nid = (neighbour.clamp(min=0) @ strides).clamp(max=counts.numel() - 1)
        cnt = torch.where(inside, counts[nid], torch.zeros_like(nid)).reshape(-1)
        beg = starts[nid].reshape(-1)
        total = int(cnt.sum())
        if total == 0:
            continue
        slot = torch.repeat_interleave(torch.arange(cnt.numel(), device=device), cnt)
        within = torch.arange(total, device=device) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        i = centres[slot // 27]
        j = order[beg[slot] + within]
        d = (pos[j] - pos[i]).norm(dim=1)
        keep = (d <= cutoff) & (i != j)
        pieces.append(torch.stack([i[keep], j[keep]]))
    if not pieces:
        return empty
    pairs = torch.cat(pieces, dim=1)
    key = pairs[0] * n_rows + pairs[1]
    return pairs[:, torch.argsort(key)]  # deterministic order, grouped by centre


def pair_vectors(positions: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable pair vectors ``r_j - r_i`` and their lengths."""
    vec = positions[pairs[1]] - positions[pairs[0]]
    return vec, vec.norm(dim=1)


def max_displacement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest distance any atom moved between two position arrays."""
    if a.shape != b.shape or a.numel() == 0:
        return float("inf") if a.shape != b.shape else 0.0
    d = a.detach() - b.detach()
    d.mul_(d)
    # summed column by column: the same value as d.norm(dim=1), in half the time (a reduction over 3 is slow in torch)
    squared = d[:, 0] + d[:, 1]
    squared += d[:, 2]
    return math.sqrt(float(squared.max()))


class VerletList:
    """A periodic neighbour list with a skin, rebuilt only when needed.

    Parameters
    ----------
    cutoff : interaction cutoff, Å.
    skin : extra search radius, Å. The list built at ``cutoff + skin`` stays
        valid while no atom moves more than ``skin / 2`` and the cell and
        species are unchanged.
    """

    def __init__(self, cutoff: float, skin: float = 0.0) -> None:
        if skin < 0:
            raise ValueError(f"VerletList: skin must be >= 0, got {skin}")
        self.cutoff, self.skin = float(cutoff), float(skin)
        self._ref: torch.Tensor | None = None
        self._cell: torch.Tensor | None = None
        self._candidates = None
        self.builds = 0

    def needs_rebuild(self, positions: torch.Tensor, cell: torch.Tensor) -> bool:
        if self._ref is None or self._ref.shape != positions.shape or not torch.equal(self._cell, cell.detach()):
            return True
        moved = max_displacement(positions, self._ref)
        return moved > 0.5 * self.skin if self.skin > 0 else moved > 0.0

    def __call__(self, positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor):
        """Pairs ``i, j, shifts`` within ``cutoff`` for the current positions."""
        if self.needs_rebuild(positions, cell):
            self._candidates = neighbor_list(positions, cell, pbc, self.cutoff + self.skin)
            self._ref, self._cell = positions.detach().clone(), cell.detach().clone()
            self.builds += 1
        i, j, s = self._candidates
        vec = positions[j] + s.to(positions.dtype) @ cell - positions[i]
        keep = vec.norm(dim=1) <= self.cutoff
        return i[keep], j[keep], s[keep]


LIST_KINDS = ("directed", "half", "one_holder")
"""What a :class:`PairLists` list holds: owned-centred pairs in both directions (``(2, P)``), each pair with an owned
end once (:func:`grouped_owned_half_pairs`), or the pairs of the half list this view evaluates when every pair of the
system is evaluated once (:func:`one_holder_pairs`)."""


class PairLists:
    """Candidate pair lists of one domain, kept for its current ghost plan.

    A domain (:meth:`~halopipe.domain.Domain.candidate_pairs`) asks for the
    owned-centred pairs within ``cutoff + skin`` among its rows (owned rows,
    then ``n_ghost`` ghosts in band order), of one of the
    :data:`LIST_KINDS`. Lists are made once per plan and distinct
    ``(n_ghost, cutoff, kind)``, so models with equal widths and cutoffs
    share one. A half or one-holder list is filtered from a wider cached one
    of its kind when there is one (a narrower view's rows are a prefix of a
    wider view's: :func:`narrower_half_pairs`; which holder keeps a pair does
    not depend on the list); a one-holder list with no wider one is filtered
    from a half list already made (:func:`one_holder_pairs`), else searched
    with the rule in the search, so the whole half list is never made. Half
    and one-holder lists are :class:`GroupedPairs`, directed lists ``(2, P)``
    tensors. Lists of older plans are dropped.
    """

    def __init__(self) -> None:
        self._lists: dict = {}
        self._version: int | None = None
        self._scratch = ScratchPool(keep=2)  # the search's buffers from rebuild to rebuild (lent to its lists): two lists a rebuild
        self._widest_row: dict[tuple[float, str], int] = {}  # the last search's most pairs of a row, per (cutoff, kind)

    def candidates(
        self,
        version: int,
        rows: torch.Tensor,
        n_owned: int,
        n_ghost: int,
        reach: float,
        cutoff: float,
        kind: str,
        keys: Callable[[], torch.Tensor] | None = None,
    ) -> GroupedPairs | torch.Tensor:
        """Pairs within ``reach`` (the model's ``cutoff`` plus the skin) for plan ``version``, of ``kind``.

        ``keys`` makes the rows' holder keys (needed for ``"one_holder"``).
        """
        if kind not in LIST_KINDS:
            raise ValueError(f"PairLists: unknown list kind {kind!r}; choose from {LIST_KINDS}")
        if version != self._version:
            self._lists, self._version = {}, version
        key = (n_ghost, cutoff, kind)
        found = self._lists.get(key)
        if found is None:
            found = self._lists[key] = self._make(version, rows, n_owned, n_ghost, reach, cutoff, kind, keys)
        return found

    def _make(self, version, rows, n_owned, n_ghost, reach, cutoff, kind, keys) -> GroupedPairs | torch.Tensor:
        if kind == "directed":
            return owned_pairs(rows, n_owned, reach)
        wider = self._smallest_wider(n_ghost, cutoff, kind)
        if wider is not None:
            return narrower_half_pairs(wider, rows, reach)
        if kind == "one_holder" and keys is None:
            raise ValueError("PairLists: a one-holder list needs the rows' holder keys")
        if kind == "one_holder" and self._smallest_wider(n_ghost, cutoff, "half") is not None:  # filtering beats a search
            return one_holder_pairs(self.candidates(version, rows, n_owned, n_ghost, reach, cutoff, "half"), keys())
        return self._search(rows, n_owned, reach, cutoff, kind, keys() if kind == "one_holder" else None)

    def _search(self, rows, n_owned: int, reach: float, cutoff: float, kind: str, keys: torch.Tensor | None) -> GroupedPairs:
        """A half or one-holder list searched afresh, its slots per row sized by the last search of its kind.

        A rebuild moves atoms by less than the skin, so a row's pairs change
        little from one to the next: 1.15x the last search's fullest row, +16,
        holds them with less memory than the density's bound, which the first
        search takes (on one process LJ 32k's one-holder rows: 80 at most, 108
        slots against 144: 15 instead of 18 MB, and the packing pass 2.3
        instead of 6.4 ms once the slots outgrow the cache). A row beyond its
        slots costs one more pass, never a pair.
        """
        widest = self._widest_row.get((cutoff, kind))
        capacity = None if widest is None else int(1.15 * widest) + 16
        found = grouped_owned_half_pairs(rows, n_owned, reach, self._scratch, keys, capacity)
        if found.n_owned:
            self._widest_row[cutoff, kind] = int(torch.diff(found.start).max())
        return found

    def _smallest_wider(self, n_ghost: int, cutoff: float, kind: str) -> GroupedPairs | None:
        """The shortest cached list of ``kind`` over at least ``n_ghost`` ghosts and ``cutoff``, if any."""
        wider = [found for (g, c, k), found in self._lists.items() if k == kind and g >= n_ghost and c >= cutoff]
        return min(wider, key=lambda found: found.n_pairs) if wider else None

    def holds(self, version: int, n_ghost: int, cutoff: float, kind: str) -> bool:
        """Whether the list of ``(n_ghost, cutoff, kind)`` for plan ``version`` is already made."""
        return version == self._version and (n_ghost, cutoff, kind) in self._lists
