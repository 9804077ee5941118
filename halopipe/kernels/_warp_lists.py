"""Warp sources of the pair lists (imported only when Warp loads): the owned-centred search and the list filters.

Both run one thread per owned row and make a list grouped by owned row. On
the CPU they write it in one pass, packed (``PACKED``): Warp runs a CPU
launch's threads one after another, in order, so row ``i`` starts writing
where row ``i - 1`` stopped (a cursor in ``counts[0]``) and records that
start in ``offsets[i]``; no packing pass. Against the slots and their
packing below (one AMD EPYC thread, the same lists): the one-holder search
of LJ 32k 6 % less with its binning, the demo's NaCl 5 / 11 Å 5 / 7 % less;
the narrower-list filter 22 % less, the one-holder filter 36 %. On a GPU
threads run at once, so there the search writes each row's pairs into
``capacity`` slots of its own in one pass
(``SLOTS``, counting past the slots), and a copy packs the slots by the
prefix sum of the counts (:data:`compact_slots`); when a row's pairs outnumber
its slots, or the slots would not fit in memory, it runs in two passes
instead: one counts each row's pairs (``COUNT``), a prefix sum turns the
counts into offsets, the other writes the pairs from the row's offset
(``FILL``). The filters (a narrower list, the one-holder list) keep a
subset of each row's pairs of a list already made, so they write in one pass
into that list's own layout (``SLOTS``: a row's kept pairs never outnumber its
pairs there) and :data:`compact_runs` packs them; two passes only where that
layout would not fit in memory. Each filter's test is compiled into its own
kernels: one kernel with the test as a ``wp.func`` argument measured 25 %
slower on the one-holder list (its row's key no longer hoisted out of the
loop). The writing passes are branch-free in
their inner loop: every candidate is written at the row's next free slot and
kept by advancing past it (while the row's slots last), which measured twice
as fast as writing under a data-dependent branch on the CPU.

Their loops over candidates and pairs are ``while`` loops, not ``range``:
Warp's ``range`` carries its step as a run-time value through the loop
(for Python's negative steps), so the C++ compiler tests it on every
iteration and neither unrolls the loop nor walks the rows by pointer. In a
loop this short that is much of the cost: the search 8-10 % faster with
``while`` (LJ 32k, NaCl 11 Å), the one-holder filter 12 % and the narrower
one 6 %, with their packing 8-11 % more. (The pair-energy kernels keep
``range``: their longer loops measured 3-4 % slower as ``while``.)
"""

from __future__ import annotations

import warp as wp

# Index kernels have no gradients; skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})

COUNT, FILL, SLOTS, PACKED = 0, 1, 2, 3

MAX_LINES = 25
"""Lines of cubes a search row scans at most: (2 r + 1)^2 for a reach of r <= 2 cubes (:func:`halopipe.neighbors._cube_edge`)."""

_ranges = wp.types.vector(length=2 * MAX_LINES, dtype=wp.int32)  # a row's scan ranges: two sections a line


@wp.func
def _slab_gap(x: wp.float64, lower: wp.float64, edge: wp.float64):
    """Distance from ``x`` to the slab ``[lower, lower + edge]`` (0 inside)."""
    return wp.max(wp.max(lower - x, x - lower - edge), wp.float64(0.0))


@wp.func
def _holder_keeps(key_a: wp.int64, key_b: wp.int64):
    """Whether the holder of owned end ``a`` keeps its pair with ghost ``b`` (keys of :meth:`~halopipe.domain.Domain.holder_keys`).

    ``b``'s low two bits: 1 or 3 for an image of an atom owned here (the
    sign of its lattice shift from that atom's row, minus or plus), kept
    when plus, so of the pairs ``(a, b + t)`` and ``(b, a - t)`` one is; 0 or
    2 for a ghost owned elsewhere, of class 0 or 1, kept when ``a``'s bit
    (bit 1 of its key) differs (the owner sees ``a`` in the flipped class
    and keeps exactly the others). So the pairs across a face split between
    its two ranks by hashed ids, whichever way ids run through space.
    """
    low = key_b & wp.int64(3)
    bit_a = (key_a >> wp.int64(1)) & wp.int64(1)
    return wp.where((low & wp.int64(1)) == wp.int64(1), low == wp.int64(3), (low >> wp.int64(1)) != bit_a)


def _owned_half_search(mode: int, one_holder: bool = False):
    """The owned-centred half-pair search: one thread per owned row ``i``, each pair within the cutoff once.

    Rows are sorted by cube (x fastest), owned rows in one section and ghost
    rows in another (``cell_start`` holds both: ghosts' cubes after the
    owned ones), so the cubes of one (y, z) line of the stencil are
    contiguous in ``sorted_rows``: one scan per line and section, trimmed to
    the cubes the cutoff sphere around ``i`` reaches (lines it misses are
    skipped). Ghost partners come from the whole stencil (a ghost is never a
    centre); owned partners from its upper half only: lines after ``i``'s
    own (z, y) line, and on that line the rows sorted after ``i``
    (``slot[i]`` is ``i``'s sorted position), so each owned pair is found from
    one end, with half the scanning. ``reach_pad`` (a hair over the cutoff)
    only widens the trim, so rounding in the binning never drops a cube; the
    pair test is exact. ``COUNT`` stores per-row counts; ``FILL`` stores the
    partners from ``offsets[i]``; ``SLOTS`` stores row ``i``'s partners'
    sorted positions ``s`` in ``partners[i * capacity ...]`` (the partner is
    ``order[s]``: looked up for the kept ones only, by :data:`compact_slots`,
    not for every candidate scanned: 11 % of the scan) and its count, which
    may exceed ``capacity`` (those are not written); ``PACKED`` (the CPU
    only) stores the partners from the cursor ``counts[0]`` while within
    ``capacity`` (the buffer's length), its start in ``offsets[i]``, and
    moves the cursor past them (counting on past the buffer). Only partners are
    written, as int32: the row of a grouped list is implied by its offsets.
    Compiled variants, because a run-time "write?" test in the inner loop
    measured 40 % slower. The ``one_holder`` variants search the one-holder
    list itself instead of a filter pass over the whole half list: the
    ghosts are binned by class in two sections (``cell_start`` holds three:
    owned rows, class 0, class 1; the images of owned atoms that a row keeps
    whatever its bit are in both), and row ``i`` scans the class it keeps
    by its key ``keys[i]`` (:func:`_holder_keeps`), so no pair is tested.

    A row first works out all its scan ranges (each line's trim and its
    ``cell_start`` bounds), then scans them: with the two interleaved, each
    line waited on its own chain of a square root, a floor and two loads
    before its first candidate, and the CPU could not start the next line's
    chain while scanning; apart, the chains of all lines overlap. The
    one-holder search of LJ 32k took 11 % less (with its binning and
    packing), the demo's NaCl 5 Å 17 % and 11 Å 8 %, the same pairs in the
    same order. The trim multiplies by ``1 / edge_x`` rather than divide
    (2-3 % of that).
    """

    @wp.kernel
    def search(
        rows: wp.array(dtype=wp.vec3d),
        sorted_rows: wp.array(dtype=wp.vec3d),
        order: wp.array(dtype=wp.int32),
        slot: wp.array(dtype=wp.int32),
        cell_of: wp.array(dtype=wp.vec3i),
        cell_start: wp.array(dtype=wp.int32),
        dims: wp.vec3i,
        lo: wp.vec3d,
        edge: wp.float64,
        edge_x: wp.float64,
        reach: wp.int32,
        reach_x: wp.int32,
        reach_pad: wp.float64,
        rc2: wp.float64,
        keys: wp.array(dtype=wp.int64),
        capacity: wp.int32,
        offsets: wp.array(dtype=wp.int32),
        partners: wp.array(dtype=wp.int32),
        counts: wp.array(dtype=wp.int32),
    ):
        i = wp.tid()
        c = cell_of[i]
        centre = rows[i]
        rel = centre - lo
        after_i = slot[i] + 1
        own_line = c[2] * dims[1] + c[1]
        n_cells = dims[0] * dims[1] * dims[2]
        ghost_base = n_cells  # the half list's one ghost section
        if wp.static(one_holder):
            # A section per ghost class: this row keeps the class unlike its own bit, every row of it (_holder_keeps).
            ghost_base = (wp.int32(2) - wp.int32((keys[i] >> wp.int64(1)) & wp.int64(1))) * n_cells
        n = wp.int32(0)
        end = wp.int32(0)
        if wp.static(mode == FILL):
            n = offsets[i]
            end = offsets[i + 1]
        elif wp.static(mode == SLOTS):
            n = i * capacity
            end = n + capacity
        elif wp.static(mode == PACKED):  # in order on the CPU: on from where the last row stopped, within the buffer
            n = counts[0]
            end = capacity
        pad2 = reach_pad * reach_pad
        inv_x = wp.float64(1.0) / edge_x
        x_lo = wp.max(c[0] - reach_x, 0)
        x_hi = wp.min(c[0] + reach_x, dims[0] - 1)
        begins = _ranges()
        ends = _ranges()
        m = wp.int32(0)
        for z in range(wp.max(c[2] - reach, 0), wp.min(c[2] + reach + 1, dims[2])):
            gz = _slab_gap(rel[2], wp.float64(z) * edge, edge)
            for y in range(wp.max(c[1] - reach, 0), wp.min(c[1] + reach + 1, dims[1])):
                gy = _slab_gap(rel[1], wp.float64(y) * edge, edge)
                h2 = pad2 - gy * gy - gz * gz
                if h2 >= wp.float64(0.0):
                    h = wp.sqrt(h2)
                    a = wp.max(wp.int32(wp.floor((rel[0] - h) * inv_x)), x_lo)
                    b = wp.min(wp.int32(wp.floor((rel[0] + h) * inv_x)), x_hi)
                    line = z * dims[1] + y
                    for section in range(2):  # owned rows, then ghost rows
                        base = wp.where(section == 0, 0, ghost_base) + line * dims[0]
                        s_begin = cell_start[base + a]
                        s_end = cell_start[base + b + 1]
                        if section == 0:
                            if line < own_line:
                                s_begin = s_end
                            elif line == own_line:
                                s_begin = wp.max(s_begin, after_i)
                        begins[m] = s_begin
                        ends[m] = s_end
                        m += 1
        k = wp.int32(0)
        while k < m:
            s = begins[k]
            s_end = ends[k]
            while s < s_end:
                d = sorted_rows[s] - centre
                keep = wp.dot(d, d) <= rc2
                if wp.static(mode == FILL or mode == PACKED):
                    if n < end:
                        partners[n] = order[s]
                elif wp.static(mode == SLOTS):
                    if n < end:
                        partners[n] = s
                n += wp.where(keep, 1, 0)
                s += 1
            k += 1
        if wp.static(mode == COUNT):
            counts[i] = n
        elif wp.static(mode == SLOTS):
            counts[i] = n - i * capacity
        elif wp.static(mode == PACKED):
            offsets[i] = counts[0]
            counts[0] = n

    return search


owned_half_count = _owned_half_search(COUNT)
owned_half_fill = _owned_half_search(FILL)
owned_half_slots = _owned_half_search(SLOTS)
owned_once_count = _owned_half_search(COUNT, one_holder=True)
owned_once_fill = _owned_half_search(FILL, one_holder=True)
owned_once_slots = _owned_half_search(SLOTS, one_holder=True)
owned_half_packed = _owned_half_search(PACKED)
owned_once_packed = _owned_half_search(PACKED, one_holder=True)


@wp.kernel
def compact_slots(
    slots: wp.array(dtype=wp.int32),
    order: wp.array(dtype=wp.int32),
    capacity: wp.int32,
    start: wp.array(dtype=wp.int32),
    partners: wp.array(dtype=wp.int32),
):
    """Row ``i``'s partners to ``start[i] .. start[i + 1]``: ``order[s]`` of the sorted positions ``s`` in its slots.

    Row ``i``'s slots are ``slots[i * capacity ...]``; every row fits its slots.
    """
    i = wp.tid()
    k = i * capacity
    out = start[i]
    end = start[i + 1]
    while out < end:
        partners[out] = order[slots[k]]
        out += 1
        k += 1


@wp.kernel
def compact_runs(
    slots: wp.array(dtype=wp.int32),
    slot_start: wp.array(dtype=wp.int32),
    start: wp.array(dtype=wp.int32),
    partners: wp.array(dtype=wp.int32),
):
    """Row ``i``'s kept partners, written by a filter from ``slots[slot_start[i]]`` on, to ``start[i] .. start[i + 1]``."""
    i = wp.tid()
    k = slot_start[i]
    out = start[i]
    end = start[i + 1]
    while out < end:
        partners[out] = slots[k]
        out += 1
        k += 1


def _half_list_filter(mode: int):
    """The narrower-list filter: one thread per owned row ``a`` over its pairs ``start[a] .. start[a + 1]`` of a wider list.

    A pair is kept when its partner is among the narrower view's ``n_rows``
    rows (a prefix of the wider view's) and within the narrower reach. The
    ``COUNT`` variant stores per-row counts; ``FILL`` stores the kept partners
    from ``offsets[a]``, in the wider list's order; ``SLOTS`` stores them from
    ``start[a]`` (the row's own range of the wider list) and the counts;
    ``PACKED`` (the CPU only) stores them from the cursor ``counts[0]``, the
    row's start in ``offsets[a]``, and moves the cursor (as the search).
    """

    @wp.kernel
    def filter_rows(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        partner: wp.array(dtype=wp.int32),
        n_rows: wp.int32,
        rc2: wp.float64,
        offsets: wp.array(dtype=wp.int32),
        kept: wp.array(dtype=wp.int32),
        counts: wp.array(dtype=wp.int32),
    ):
        a = wp.tid()
        centre = rows[a]
        n = wp.int32(0)
        end = wp.int32(0)
        if wp.static(mode == FILL):
            n = offsets[a]
            end = offsets[a + 1]
        elif wp.static(mode == SLOTS):
            n = start[a]
        elif wp.static(mode == PACKED):  # in order on the CPU: on from where the last row stopped
            n = counts[0]
        k = start[a]
        stop = start[a + 1]
        while k < stop:
            b = partner[k]
            d = rows[wp.min(b, n_rows - 1)] - centre  # a row beyond the view reads a stand-in
            keep = b < n_rows and wp.dot(d, d) <= rc2
            if wp.static(mode == FILL):
                if n < end:
                    kept[n] = b
            elif wp.static(mode == SLOTS or mode == PACKED):
                kept[n] = b
            n += wp.where(keep, 1, 0)
            k += 1
        if wp.static(mode == COUNT):
            counts[a] = n
        elif wp.static(mode == SLOTS):
            counts[a] = n - start[a]
        elif wp.static(mode == PACKED):
            offsets[a] = counts[0]
            counts[0] = n

    return filter_rows


half_list_count = _half_list_filter(COUNT)
half_list_fill = _half_list_filter(FILL)
half_list_slots = _half_list_filter(SLOTS)
half_list_packed = _half_list_filter(PACKED)


def _one_holder_filter(mode: int):
    """The one-holder filter: one thread per owned row ``a`` over its pairs ``start[a] .. start[a + 1]`` of a half list.

    Keeps an owned-owned pair, and a pair with a ghost ``b`` by
    :func:`_holder_keeps` (see :func:`halopipe.neighbors.one_holder_pairs`),
    reading keys for ghost partners only. ``COUNT``, ``FILL``, ``SLOTS`` and
    ``PACKED`` variants as :func:`_half_list_filter`.
    """

    @wp.kernel
    def filter_holders(
        start: wp.array(dtype=wp.int32),
        partner: wp.array(dtype=wp.int32),
        key: wp.array(dtype=wp.int64),
        n_owned: wp.int32,
        offsets: wp.array(dtype=wp.int32),
        kept: wp.array(dtype=wp.int32),
        counts: wp.array(dtype=wp.int32),
    ):
        a = wp.tid()
        key_a = key[a]
        n = wp.int32(0)
        end = wp.int32(0)
        if wp.static(mode == FILL):
            n = offsets[a]
            end = offsets[a + 1]
        elif wp.static(mode == SLOTS):
            n = start[a]
        elif wp.static(mode == PACKED):  # in order on the CPU: on from where the last row stopped
            n = counts[0]
        k = start[a]
        stop = start[a + 1]
        while k < stop:
            b = partner[k]
            keep = True
            if b >= n_owned:
                keep = _holder_keeps(key_a, key[b])
            if wp.static(mode == FILL):
                if n < end:
                    kept[n] = b
            elif wp.static(mode == SLOTS or mode == PACKED):
                kept[n] = b
            n += wp.where(keep, 1, 0)
            k += 1
        if wp.static(mode == COUNT):
            counts[a] = n
        elif wp.static(mode == SLOTS):
            counts[a] = n - start[a]
        elif wp.static(mode == PACKED):
            offsets[a] = counts[0]
            counts[0] = n

    return filter_holders


one_holder_count = _one_holder_filter(COUNT)
one_holder_fill = _one_holder_filter(FILL)
one_holder_slots = _one_holder_filter(SLOTS)
one_holder_packed = _one_holder_filter(PACKED)
