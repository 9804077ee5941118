"""Warp sources of the halo geometry (imported only when Warp loads): the images of atoms near bricks.

One thread per atom walks its candidate (brick, lattice image) combinations
axis by axis, entering the next axis only where the current one is within the
width, so it visits the few candidates an atom really has. On the CPU one pass
writes them packed, as the pair lists do (:mod:`._warp_lists`: a CPU launch
runs its threads in order); on a GPU two: one counts each atom's images, a
prefix sum makes the offsets, the other writes them. An owned atom deeper inside its own brick than the width
has none, and both passes skip it at once (on one rank, Lennard-Jones 32k:
about half the atoms; the plan's images 3.3 -> 2.2 ms a rebuild). The order
(by atom, then brick and image along axis 0, 1, 2) and the arithmetic are
those of the torch version in :func:`halopipe.geometry.images_near_bricks`,
so both give the same images in the same order, bit for bit. The walk's
loops are ``while`` loops: Warp's ``range`` tests its run-time step on every
iteration (for Python's negative steps), which in loops of one to three
iterations was a fifth of the walk (LJ 32k's 19,900 images: 1.82 -> 1.50 ms;
the demo composite's 15,500: 1.03 -> 0.83 ms; see :mod:`._warp_lists`).
"""

from __future__ import annotations

import warp as wp

# Index kernels have no gradients; skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})


@wp.func
def _excess(x: wp.float64, lo: wp.float64, hi: wp.float64, height: wp.float64):
    """Distance (Å) of fractional ``x`` outside the slab ``[lo, hi]`` along an axis of ``height`` Å per unit; 0 inside (and for NaN)."""
    e = wp.max(lo - x, x - hi)
    if not (e > wp.float64(0.0)):
        e = wp.float64(0.0)
    return e * height


@wp.func
def _brick_of_rank(rank: wp.int32, grid: wp.vec3i):
    """The brick index of ``rank`` (``Partition.brick_index_of_rank``: the last axis fastest)."""
    return wp.vec3i(rank / (grid[1] * grid[2]), (rank / grid[2]) % grid[1], rank % grid[2])


@wp.func
def _deeper_than(
    x: wp.vec3d,
    rank: wp.int32,
    grid: wp.vec3i,
    bounds0: wp.array(dtype=wp.float64),
    bounds1: wp.array(dtype=wp.float64),
    bounds2: wp.array(dtype=wp.float64),
    heights: wp.vec3d,
    width: wp.float64,
):
    """Whether fractional ``x`` lies deeper than ``width`` (Å) inside the brick of ``rank`` along every axis.

    Such an owned atom has no image within ``width`` of any brick: the bricks
    tile each axis within one period without overlap, so any other brick or
    lattice image lies at least that depth away along some axis. The margin
    keeps rounding from ever skipping an atom that has an image.
    """
    b = _brick_of_rank(rank, grid)
    d0 = wp.min(x[0] - bounds0[b[0]], bounds0[b[0] + 1] - x[0]) * heights[0]
    d1 = wp.min(x[1] - bounds1[b[1]], bounds1[b[1] + 1] - x[1]) * heights[1]
    d2 = wp.min(x[2] - bounds2[b[2]], bounds2[b[2] + 1] - x[2]) * heights[2]
    return wp.min(wp.min(d0, d1), d2) > width * wp.float64(1.0 + 1e-9) + wp.float64(1e-9)


COUNT, FILL, PACKED = 0, 1, 2


def _images_near_bricks(mode: int):
    """Count (``COUNT``) or write (``FILL``, from ``offsets[atom]``) each atom's images within ``width`` of some brick.

    ``PACKED`` (the CPU only, where a launch runs its threads in order)
    writes them in the one pass, from the cursor ``counts[0]`` on while
    within the outputs' length, stores each atom's start in ``offsets`` and
    moves the cursor past its images (counting on past the outputs), as the
    pair search does (:mod:`._warp_lists`). ``reach[a]`` bounds the lattice
    images ``-reach[a] .. reach[a]`` along axis ``a`` (0 where it is not
    periodic). With ``exclude``, the image at which an atom is an owned row
    of its owner's brick (``own_rank``, ``own_image``) is left out.
    """
    write = mode != COUNT

    @wp.kernel
    def images(
        wrapped: wp.array(dtype=wp.vec3d),
        image: wp.array(dtype=wp.vec3i),
        bounds0: wp.array(dtype=wp.float64),
        bounds1: wp.array(dtype=wp.float64),
        bounds2: wp.array(dtype=wp.float64),
        grid: wp.vec3i,
        reach: wp.vec3i,
        heights: wp.vec3d,
        width: wp.float64,
        exclude: wp.int32,
        own_rank: wp.array(dtype=wp.int32),
        own_image: wp.array(dtype=wp.vec3i),
        offsets: wp.array(dtype=wp.int32),
        atom_out: wp.array(dtype=wp.int64),
        rank_out: wp.array(dtype=wp.int64),
        shift_out: wp.array(dtype=wp.vec3i),
        distance_out: wp.array(dtype=wp.float64),
        counts: wp.array(dtype=wp.int32),
    ):
        i = wp.tid()
        w = wrapped[i]
        n = wp.int32(0)
        limit = atom_out.shape[0]
        if wp.static(mode == FILL):
            n = offsets[i]
            if offsets[i + 1] == n:  # no images (most atoms inside a brick)
                return
        if wp.static(mode == PACKED):
            n = counts[0]
            offsets[i] = n
        if wp.static(mode != FILL):
            if exclude != 0:
                home = own_image[i]
                owned = w + wp.vec3d(wp.float64(home[0]), wp.float64(home[1]), wp.float64(home[2]))
                if _deeper_than(owned, own_rank[i], grid, bounds0, bounds1, bounds2, heights, width):
                    if wp.static(mode == COUNT):
                        counts[i] = 0
                    return
        b0 = int(0)  # noqa: UP018 - Warp: a dynamic variable (while loops, not range: see the module docstring)
        while b0 < grid[0]:
            s0 = -reach[0]
            while s0 <= reach[0]:
                e0 = _excess(w[0] + wp.float64(s0), bounds0[b0], bounds0[b0 + 1], heights[0])
                if e0 <= width:
                    b1 = int(0)  # noqa: UP018
                    while b1 < grid[1]:
                        s1 = -reach[1]
                        while s1 <= reach[1]:
                            e1 = _excess(w[1] + wp.float64(s1), bounds1[b1], bounds1[b1 + 1], heights[1])
                            if e1 <= width:
                                b2 = int(0)  # noqa: UP018
                                while b2 < grid[2]:
                                    s2 = -reach[2]
                                    while s2 <= reach[2]:
                                        e2 = _excess(w[2] + wp.float64(s2), bounds2[b2], bounds2[b2 + 1], heights[2])
                                        if e2 <= width:
                                            rank = (b0 * grid[1] + b1) * grid[2] + b2
                                            keep = True
                                            if exclude != 0:
                                                home = own_image[i]
                                                if rank == own_rank[i] and s0 == home[0] and s1 == home[1] and s2 == home[2]:
                                                    keep = False
                                            if keep:
                                                if wp.static(write):
                                                    if n < limit:
                                                        atom_out[n] = wp.int64(i)
                                                        rank_out[n] = wp.int64(rank)
                                                        shift_out[n] = wp.vec3i(s0, s1, s2) - image[i]
                                                        distance_out[n] = wp.max(wp.max(e0, e1), e2)
                                                n += 1
                                        s2 += 1
                                    b2 += 1
                            s1 += 1
                        b1 += 1
                s0 += 1
            b0 += 1
        if wp.static(mode == COUNT):
            counts[i] = n
        elif wp.static(mode == PACKED):
            counts[0] = n

    return images


images_near_bricks_count = _images_near_bricks(COUNT)
images_near_bricks_fill = _images_near_bricks(FILL)
images_near_bricks_packed = _images_near_bricks(PACKED)


@wp.func
def _nearest_along(x: wp.float64, lo: wp.float64, hi: wp.float64, height: wp.float64, periodic: wp.int32):
    """(image, excess) of the image of ``x`` among 0, -1, +1 (0 only where not periodic) nearest the slab; the first on ties."""
    best = wp.float64(0.0)
    least = _excess(x, lo, hi, height)
    if periodic != 0 and least > wp.float64(0.0):  # inside at image 0 (most rows): no other image is nearer
        below = _excess(x + wp.float64(-1.0), lo, hi, height)
        if below < least:
            best = wp.float64(-1.0)
            least = below
        above = _excess(x + wp.float64(1.0), lo, hi, height)
        if above < least:
            best = wp.float64(1.0)
            least = above
    return wp.vec2d(best, least)


@wp.kernel
def nearest_image(
    wrapped: wp.array(dtype=wp.vec3d),
    brick: wp.array(dtype=wp.vec3i),
    bounds0: wp.array(dtype=wp.float64),
    bounds1: wp.array(dtype=wp.float64),
    bounds2: wp.array(dtype=wp.float64),
    periodic: wp.vec3i,
    heights: wp.vec3d,
    images: wp.array(dtype=wp.vec3i),
    distance: wp.array(dtype=wp.float64),
):
    """Per atom, the periodic image nearest its brick and the slab distance outside it (the torch version's candidates and order)."""
    i = wp.tid()
    w = wrapped[i]
    b = brick[i]
    n0 = _nearest_along(w[0], bounds0[b[0]], bounds0[b[0] + 1], heights[0], periodic[0])
    n1 = _nearest_along(w[1], bounds1[b[1]], bounds1[b[1] + 1], heights[1], periodic[1])
    n2 = _nearest_along(w[2], bounds2[b[2]], bounds2[b[2] + 1], heights[2], periodic[2])
    images[i] = wp.vec3i(wp.int32(n0[0]), wp.int32(n1[0]), wp.int32(n2[0]))
    distance[i] = wp.max(wp.max(wp.max(wp.float64(0.0), n0[1]), n1[1]), n2[1])


@wp.func
def _wrap_along(x: wp.float64, periodic: wp.int32):
    """The lattice image ``floor(x)`` removed by wrapping along a periodic axis; 0 along an open one."""
    if periodic != 0:
        return wp.floor(x)
    return wp.float64(0.0)


@wp.func
def _brick_along(x: wp.float64, bounds: wp.array(dtype=wp.float64)):
    """The brick holding ``x`` along an axis: how many inner bounds lie at or below it (``torch.bucketize(..., right=True)``)."""
    k = wp.int32(0)
    for j in range(1, bounds.shape[0] - 1):
        if bounds[j] <= x:
            k += 1
    return k


@wp.kernel
def place_rows(
    frac: wp.array(dtype=wp.vec3d),
    bounds0: wp.array(dtype=wp.float64),
    bounds1: wp.array(dtype=wp.float64),
    bounds2: wp.array(dtype=wp.float64),
    grid: wp.vec3i,
    periodic: wp.vec3i,
    heights: wp.vec3d,
    rank: wp.int32,
    wrapped: wp.array(dtype=wp.vec3d),
    image: wp.array(dtype=wp.vec3i),
    owner: wp.array(dtype=wp.int32),
    home: wp.array(dtype=wp.vec3i),
    outside: wp.array(dtype=wp.float64),
):
    """Per row, in one pass: its wrapped coordinates and image, the rank of the brick holding it, and its image nearest
    ``rank``'s brick with the slab distance outside that brick (the arithmetic of the torch wrap, bucketize and
    :data:`nearest_image`)."""
    i = wp.tid()
    f = frac[i]
    m = wp.vec3d(_wrap_along(f[0], periodic[0]), _wrap_along(f[1], periodic[1]), _wrap_along(f[2], periodic[2]))
    w = f - m
    wrapped[i] = w
    image[i] = wp.vec3i(wp.int32(m[0]), wp.int32(m[1]), wp.int32(m[2]))
    owner[i] = (_brick_along(w[0], bounds0) * grid[1] + _brick_along(w[1], bounds1)) * grid[2] + _brick_along(w[2], bounds2)
    b = _brick_of_rank(rank, grid)
    n0 = _nearest_along(w[0], bounds0[b[0]], bounds0[b[0] + 1], heights[0], periodic[0])
    n1 = _nearest_along(w[1], bounds1[b[1]], bounds1[b[1] + 1], heights[1], periodic[1])
    n2 = _nearest_along(w[2], bounds2[b[2]], bounds2[b[2] + 1], heights[2], periodic[2])
    home[i] = wp.vec3i(wp.int32(n0[0]), wp.int32(n1[0]), wp.int32(n2[0]))
    outside[i] = wp.max(wp.max(wp.max(wp.float64(0.0), n0[1]), n1[1]), n2[1])
