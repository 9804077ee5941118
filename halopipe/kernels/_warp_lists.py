"""Warp sources of the half-list filter (imported only when Warp loads).

A narrower half list (smaller cutoff, fewer ghost rows) is a subset of a wider
one of the same plan, row by row: one thread per owned row ``a`` walks its
pairs ``start[a] .. start[a + 1]`` of the wider list grouped by owned row and
keeps those whose partner is among the narrower view's rows and within the
narrower reach. A counting pass, a prefix sum and a writing pass give the
narrower list, still grouped by owned row and in the wider list's order.
"""

from __future__ import annotations

import warp as wp

# Index kernels have no gradients; skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})


def _half_list_filter(write: bool):
    """The filter: per-row counts (``write`` False) or the kept pairs written from ``offsets[a]`` (two compiled variants)."""

    @wp.kernel
    def filter_rows(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        pairs: wp.array2d(dtype=wp.int64),
        n_rows: wp.int64,
        rc2: wp.float64,
        offsets: wp.array(dtype=wp.int32),
        kept: wp.array2d(dtype=wp.int64),
        counts: wp.array(dtype=wp.int32),
    ):
        a = wp.tid()
        centre = rows[a]
        n = wp.int32(0)
        offset = wp.int32(0)
        if wp.static(write):
            offset = offsets[a]
        for k in range(start[a], start[a + 1]):
            b = pairs[1, k]
            if b < n_rows:
                d = rows[wp.int32(b)] - centre
                if wp.dot(d, d) <= rc2:
                    if wp.static(write):
                        kept[0, offset + n] = wp.int64(a)
                        kept[1, offset + n] = b
                    n += 1
        if not wp.static(write):
            counts[a] = n

    return filter_rows


half_list_count = _half_list_filter(write=False)
half_list_fill = _half_list_filter(write=True)


def _owned_half_search(write: bool):
    """The owned-centred half-pair search: one thread per owned row ``i``, keeping rows ``j > i`` within the cutoff.

    Rows are sorted by cube (x fastest), so the cubes of one (y, z) line of
    the stencil are contiguous in ``sorted_rows``: one scan per line. The
    counting variant (``write`` False) stores per-row counts; the writing one
    stores the pairs from ``offsets[i]``. Two compiled variants, because a
    run-time "write?" test in the inner loop measured 40 % slower. (Trimming
    each line to the cutoff sphere scans fewer rows but measured slower too.)
    """

    @wp.kernel
    def search(
        rows: wp.array(dtype=wp.vec3d),
        sorted_rows: wp.array(dtype=wp.vec3d),
        order: wp.array(dtype=wp.int32),
        cell_of: wp.array(dtype=wp.vec3i),
        cell_start: wp.array(dtype=wp.int32),
        dims: wp.vec3i,
        reach: wp.int32,
        rc2: wp.float64,
        offsets: wp.array(dtype=wp.int32),
        pairs: wp.array2d(dtype=wp.int64),
        counts: wp.array(dtype=wp.int32),
    ):
        i = wp.tid()
        c = cell_of[i]
        centre = rows[i]
        n = wp.int32(0)
        offset = wp.int32(0)
        if wp.static(write):
            offset = offsets[i]
        x_lo = wp.max(c[0] - reach, 0)
        x_hi = wp.min(c[0] + reach, dims[0] - 1)
        for z in range(wp.max(c[2] - reach, 0), wp.min(c[2] + reach + 1, dims[2])):
            for y in range(wp.max(c[1] - reach, 0), wp.min(c[1] + reach + 1, dims[1])):
                line = (z * dims[1] + y) * dims[0]
                for s in range(cell_start[line + x_lo], cell_start[line + x_hi + 1]):
                    j = order[s]
                    d = sorted_rows[s] - centre
                    if j > i and wp.dot(d, d) <= rc2:
                        if wp.static(write):
                            pairs[0, offset + n] = wp.int64(i)
                            pairs[1, offset + n] = wp.int64(j)
                        n += 1
        if not wp.static(write):
            counts[i] = n

    return search


owned_half_count = _owned_half_search(write=False)
owned_half_fill = _owned_half_search(write=True)
