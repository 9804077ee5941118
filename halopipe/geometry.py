"""Bricks of space and the periodic images that fall near them.

The cell is cut into ``px * py * pz`` bricks along its fractional coordinates,
one per rank. On a periodic axis brick ``b`` covers ``[b/p, (b+1)/p)``; on a
non-periodic axis the atoms' current extent is cut evenly and the outermost
bricks reach to infinity. Distances to a brick are measured per axis,
perpendicular to the brick's faces (the slab metric LAMMPS uses): an image is
within ``w`` of a brick when, along every axis, it lies within ``w`` of the
brick's slab. This is a superset of the Euclidean ``w``-neighbourhood, so no
pair within a cutoff is ever missed, for any cell shape.

Everything here is pure geometry on tensors (no communication, no Python loops
over atoms). The single-process domain uses it with a single brick; the
distributed package (``halopipe.distributed``) adds only the communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels.backend import warp_module
from .kernels.pairs import launch, launch_packed, packs_in_order, warp_kernel

__all__ = ["Geometry", "Partition", "Placement", "choose_grid", "ImageSet", "images_near_bricks"]

_GEOMETRY = "_warp_geometry"  # the Warp source of the kernels here (halopipe.kernels._warp_geometry)


def choose_grid(world_size: int, cell: torch.Tensor, pbc: torch.Tensor, extent: torch.Tensor | None = None) -> tuple[int, int, int]:
    """The factorisation ``px*py*pz == world_size`` that minimises brick surface.

    Brick edge lengths are the heights of the (working) cell along each axis
    divided by the number of bricks on that axis. Ties (a cubic cell) go to
    the most bricks along the first axis, then the second: the axes a
    distributed mesh FFT splits (slabs of mesh axis 0, pencils of axes 0 and 1,
    :mod:`halopipe.distributed.fft`), so that a particle-mesh model's box of
    mesh points, around the rank's brick, meets the other ranks' blocks only
    in its ghost layer (NaCl 4k with ``PME(8, 1e-4)`` on 2 ranks: 2,229 ->
    1,582 KiB sent a step).
    """
    geo = Geometry(cell, pbc, extent)
    heights = geo.heights.tolist()
    best, best_area = (world_size, 1, 1), math.inf
    for px in range(1, world_size + 1):
        if world_size % px:
            continue
        for py in range(1, world_size // px + 1):
            if (world_size // px) % py:
                continue
            pz = world_size // px // py
            a, b, c = heights[0] / px, heights[1] / py, heights[2] / pz
            area = a * b + b * c + a * c
            tie = abs(area - best_area) <= 1e-12 * area
            if (area < best_area and not tie) or (tie and (px, py) > best[:2]):
                best, best_area = (px, py, pz), area
    return best


class Geometry:
    """A working basis for fractional coordinates, valid with non-periodic axes.

    Periodic axes use the lattice vectors. A non-periodic axis keeps its lattice
    vector when the cell is non-singular, otherwise it is replaced by a unit
    vector orthogonal to the other rows, so that fractional coordinates are
    always defined.
    """

    def __init__(self, cell: torch.Tensor, pbc: torch.Tensor, extent: torch.Tensor | None = None) -> None:
        cell = cell.detach().to(torch.float64)
        self.pbc = pbc.detach().cpu().to(torch.bool)
        self.basis = _working_basis(cell, self.pbc)
        self.inverse = torch.linalg.inv(self.basis)
        # Height of the cell along axis a = 1 / |reciprocal vector a|.
        self.heights = 1.0 / self.inverse.norm(dim=0)

    def fractional(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.detach().to(torch.float64) @ self.inverse.to(positions.device)


def _working_basis(cell: torch.Tensor, pbc: torch.Tensor) -> torch.Tensor:
    basis = cell.clone().cpu()
    if abs(float(torch.linalg.det(basis))) > 1e-10 * max(float(basis.norm()) ** 3, 1e-30):
        return basis.to(cell.device)
    eye = torch.eye(3, dtype=basis.dtype)
    periodic = [a for a in range(3) if pbc[a]]
    for a in range(3):
        if a in periodic:
            continue
        others = [basis[b] for b in periodic] + [basis[b] for b in range(3) if b not in periodic and b < a]
        v = None
        if len(others) == 2:
            v = torch.linalg.cross(others[0], others[1])
        else:
            for e in eye:  # Gram-Schmidt against what we already have
                cand = e.clone()
                for o in others:
                    cand = cand - (cand @ o) / (o @ o) * o
                if cand.norm() > 1e-6:
                    v = cand
                    break
        basis[a] = v / v.norm()
    return basis.to(cell.device)


@dataclass
class Partition:
    """A regular grid of bricks in fractional coordinates.

    ``lower``/``upper`` hold each axis's brick boundaries (length ``p + 1``);
    on non-periodic axes the outer boundaries are ``-inf``/``+inf``.
    """

    grid: tuple[int, int, int]
    geometry: Geometry
    bounds: list[torch.Tensor]  # per axis, p+1 boundaries in fractional coordinates

    @classmethod
    def build(cls, grid, cell, pbc, frac_min: torch.Tensor | None = None, frac_max: torch.Tensor | None = None) -> Partition:
        geo = Geometry(cell, pbc)
        bounds = []
        for a in range(3):
            p = int(grid[a])
            if geo.pbc[a]:
                b = torch.linspace(0.0, 1.0, p + 1, dtype=torch.float64)
            else:
                lo = float(frac_min[a]) if frac_min is not None else 0.0
                hi = float(frac_max[a]) if frac_max is not None else 1.0
                b = torch.linspace(lo, hi, p + 1, dtype=torch.float64)
                b[0], b[-1] = -math.inf, math.inf
            bounds.append(b)
        return cls(tuple(int(g) for g in grid), geo, bounds)

    def rank_of(self, brick_index: torch.Tensor) -> torch.Tensor:
        """Rank of brick ``(i, j, k)``: ``i * py * pz + j * pz + k``."""
        _, py, pz = self.grid
        return brick_index[..., 0] * py * pz + brick_index[..., 1] * pz + brick_index[..., 2]

    def wrap(self, frac: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Wrap periodic fractional coordinates into [0, 1); returns (wrapped, integer image)."""
        image = torch.where(self.geometry.pbc.to(frac.device), torch.floor(frac), torch.zeros_like(frac))
        return frac - image, image.to(torch.int64)

    def brick_index(self, wrapped: torch.Tensor) -> torch.Tensor:
        """Brick index (N, 3) containing each wrapped fractional coordinate."""
        cols = []
        for a in range(3):
            inner = self.bounds[a][1:-1].to(wrapped.device)
            cols.append(torch.bucketize(wrapped[:, a].contiguous(), inner, right=True))
        return torch.stack(cols, dim=1)

    def nearest_image(self, wrapped: torch.Tensor, brick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The periodic image of each point closest to the given brick.

        Returns the integer image ``n`` (N, 3) relative to ``wrapped`` and the
        slab distance (Å) of ``wrapped + n`` outside the brick (0 inside).
        """
        device = wrapped.device
        kernel = warp_kernel("nearest_image", _GEOMETRY)
        if kernel is not None:
            return self._warp_nearest_image(kernel, wrapped, brick)
        dist = torch.zeros(wrapped.shape[0], dtype=torch.float64, device=device)
        images = torch.zeros(wrapped.shape, dtype=torch.int64, device=device)
        for a in range(3):
            lo = self.bounds[a].to(device)[brick[:, a]]
            hi = self.bounds[a].to(device)[brick[:, a] + 1]
            cand = torch.tensor([0, -1, 1] if self.geometry.pbc[a] else [0], device=device)
            x = wrapped[:, a, None] + cand[None, :].to(torch.float64)
            ex = torch.clamp(torch.maximum(lo[:, None] - x, x - hi[:, None]), min=0.0)
            ex = torch.nan_to_num(ex, nan=0.0) * float(self.geometry.heights[a])
            best = ex.argmin(dim=1)
            images[:, a] = cand[best]
            dist = torch.maximum(dist, ex.gather(1, best[:, None])[:, 0])
        return images, dist

    def _warp_nearest_image(self, kernel, wrapped: torch.Tensor, brick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`nearest_image` by one Warp thread per point (the same candidates, order and arithmetic)."""
        wp, device, n = warp_module(), wrapped.device, wrapped.shape[0]
        images = torch.empty(n, 3, dtype=torch.int32, device=device)
        dist = torch.empty(n, dtype=torch.float64, device=device)
        inputs = [
            wrapped.to(torch.float64).contiguous(),
            brick.to(device=device, dtype=torch.int32).contiguous(),
            *_bounds_on(self, device),
            wp.vec3i(*[int(bool(p)) for p in self.geometry.pbc]),
            wp.vec3d(*[float(h) for h in self.geometry.heights]),
        ]
        launch(kernel, n, device, inputs, [images, dist])
        return images.to(torch.int64), dist

    def brick_index_of_rank(self, rank: torch.Tensor) -> torch.Tensor:
        """(N, 3) brick index of each given rank."""
        _, py, pz = self.grid
        return torch.stack([rank // (py * pz), (rank // pz) % py, rank % pz], dim=1)

    def place(self, frac: torch.Tensor, rank: int) -> Placement:
        """Where each row of fractional coordinates ``frac`` lies: wrapped, in which brick, and as seen from ``rank``'s brick.

        One pass with Warp; otherwise :meth:`wrap`, :meth:`brick_index`,
        :meth:`rank_of` and :meth:`nearest_image` in turn, with the same
        arithmetic, so both give the same result bit for bit.
        """
        kernel = warp_kernel("place_rows", _GEOMETRY)
        if kernel is not None:
            return self._warp_place(kernel, frac, rank)
        wrapped, image = self.wrap(frac)
        brick = self.brick_index_of_rank(torch.full((frac.shape[0],), int(rank), dtype=torch.int64, device=frac.device))
        home, outside = self.nearest_image(wrapped, brick)
        return Placement(wrapped, image, self.rank_of(self.brick_index(wrapped)), home, outside)

    def _warp_place(self, kernel, frac: torch.Tensor, rank: int) -> Placement:
        """:meth:`place` by one Warp thread per row."""
        wp, device, n = warp_module(), frac.device, frac.shape[0]
        wrapped = torch.empty(n, 3, dtype=torch.float64, device=device)
        image, home = torch.empty(n, 3, dtype=torch.int32, device=device), torch.empty(n, 3, dtype=torch.int32, device=device)
        owner = torch.empty(n, dtype=torch.int32, device=device)
        outside = torch.empty(n, dtype=torch.float64, device=device)
        inputs = [
            frac.to(torch.float64).contiguous(),
            *_bounds_on(self, device),
            wp.vec3i(*self.grid),
            wp.vec3i(*[int(bool(p)) for p in self.geometry.pbc]),
            wp.vec3d(*[float(h) for h in self.geometry.heights]),
            int(rank),
        ]
        launch(kernel, n, device, inputs, [wrapped, image, owner, home, outside])
        return Placement(wrapped, image.to(torch.int64), owner.to(torch.int64), home.to(torch.int64), outside)


@dataclass
class Placement:
    """Rows placed in a :class:`Partition` as seen from one rank's brick (:meth:`Partition.place`).

    ``wrapped`` (N, 3): fractional coordinates wrapped into the cell along
    periodic axes; ``image`` (N, 3): the integer image that wrapping removed
    (the row is ``wrapped + image``); ``owner`` (N,): the rank of the brick
    holding ``wrapped``; ``home`` (N, 3): the image (relative to ``wrapped``)
    nearest the rank's brick, and ``outside`` (N,) its slab distance (Å)
    outside that brick, 0 inside.
    """

    wrapped: torch.Tensor
    image: torch.Tensor
    owner: torch.Tensor
    home: torch.Tensor
    outside: torch.Tensor


@dataclass
class ImageSet:
    """Images of local atoms that lie near some brick.

    ``atom`` indexes the local atoms, ``rank`` is the brick (rank) they fall
    near, ``shift`` the integer lattice image to add to the atom's stored
    position, and ``distance`` the slab distance (Å) to that brick.
    """

    atom: torch.Tensor
    rank: torch.Tensor
    shift: torch.Tensor
    distance: torch.Tensor


def images_near_bricks(
    partition: Partition,
    wrapped: torch.Tensor,
    image: torch.Tensor,
    width: float,
    own_rank: torch.Tensor | None = None,
    own_image: torch.Tensor | None = None,
) -> ImageSet:
    """All images of the given atoms within ``width`` (slab metric) of any brick.

    Parameters
    ----------
    wrapped, image : fractional coordinates wrapped into the cell and the
        integer image removed by wrapping (so the stored position is
        ``wrapped + image`` in fractional units).
    width : halo width in Å.
    own_rank : optional (N,) owner of each atom; the image at which the atom
        is an owned row (``own_image``, default 0, relative to ``wrapped``) in
        its owner's brick is excluded: it is not a ghost.

    With Warp, one thread per atom walks its candidates axis by axis
    (:mod:`halopipe.kernels._warp_geometry`); otherwise this works per axis on
    dense candidate masks (atoms x bricks x images), then combines the axes by
    broadcasting. Both give the same images in the same order, and neither
    loops over atoms in Python.
    """
    if warp_kernel("images_near_bricks_fill", _GEOMETRY) is not None:
        return _warp_images_near_bricks(partition, wrapped, image, width, own_rank, own_image)
    device = wrapped.device
    per_axis = []
    for a in range(3):
        p = partition.grid[a]
        bounds = partition.bounds[a].to(device)
        periodic = bool(partition.geometry.pbc[a])
        if periodic:
            reach = _image_reach(partition, width)[a]
            n_img = torch.arange(-reach, reach + 1, device=device)
        else:
            n_img = torch.zeros(1, dtype=torch.int64, device=device)
        bricks = torch.arange(p, device=device)
        x = wrapped[:, a, None, None] + n_img[None, None, :].to(torch.float64)  # (N, 1, I)
        lo = bounds[bricks][None, :, None]
        hi = bounds[bricks + 1][None, :, None]
        excess = torch.clamp(torch.maximum(lo - x, x - hi), min=0.0)  # (N, P, I)
        excess = torch.nan_to_num(excess, nan=0.0) * float(partition.geometry.heights[a])
        inside = excess <= width
        per_axis.append((inside, excess, n_img))
    # Pack each axis's valid (brick, image) candidates to the front so the
    # product over axes only spans the few candidates an atom really has.
    packed = [_pack_axis(inside, excess, n_img) for inside, excess, n_img in per_axis]
    (v0, b0, s0, e0), (v1, b1, s1, e1), (v2, b2, s2, e2) = packed
    mask = v0[:, :, None, None] & v1[:, None, :, None] & v2[:, None, None, :]
    atom, c0, c1, c2 = mask.nonzero(as_tuple=True)
    b = torch.stack([b0[atom, c0], b1[atom, c1], b2[atom, c2]], dim=1)
    shift_wrapped = torch.stack([s0[atom, c0], s1[atom, c1], s2[atom, c2]], dim=1)
    dist = torch.maximum(torch.maximum(e0[atom, c0], e1[atom, c1]), e2[atom, c2])
    rank = partition.rank_of(b)
    # Shift relative to the stored (unwrapped) position.
    shift = shift_wrapped - image[atom]
    if own_rank is not None:
        home = torch.zeros_like(shift_wrapped) if own_image is None else own_image[atom]
        keep = ~((rank == own_rank[atom]) & (shift_wrapped == home).all(dim=1))
        atom, rank, shift, dist = atom[keep], rank[keep], shift[keep], dist[keep]
    return ImageSet(atom=atom, rank=rank, shift=shift, distance=dist)


def _bounds_on(partition: Partition, device: torch.device) -> list[torch.Tensor]:
    """The brick bounds along each axis, float64 on ``device``, as the Warp geometry kernels read them."""
    return [partition.bounds[a].to(device=device, dtype=torch.float64).contiguous() for a in range(3)]


def _image_reach(partition: Partition, width: float) -> list[int]:
    """Per axis, how many lattice images either way can lie within ``width`` of a brick (0 where not periodic).

    A wrapped coordinate ``x`` lies in [0, 1] and so do the bricks, so image
    ``x + s`` is within ``w = width / height`` of one only if
    ``|s| <= 1 + w``: ``1 + floor(w)`` images either way (one for a width
    under the height, where ``ceil(w) + 1`` scanned two).
    """
    return [int(math.floor(width / float(h))) + 1 if bool(p) else 0 for h, p in zip(partition.geometry.heights, partition.geometry.pbc)]


def _warp_images_near_bricks(
    partition: Partition,
    wrapped: torch.Tensor,
    image: torch.Tensor,
    width: float,
    own_rank: torch.Tensor | None,
    own_image: torch.Tensor | None,
) -> ImageSet:
    """:func:`images_near_bricks` by the Warp kernels: count per atom, prefix sum, write; on the CPU one packed pass.

    The packed pass (rows in order: :mod:`halopipe.kernels._warp_geometry`)
    writes into outputs with room for :data:`PACKED_IMAGES_ROOM`; should
    there be more images, its starts are right, so the write pass follows.
    """
    wp = warp_module()
    device, n = wrapped.device, wrapped.shape[0]
    as32 = lambda x: x.to(device=device, dtype=torch.int32).contiguous()  # noqa: E731
    exclude = own_rank is not None
    home = own_image if own_image is not None else torch.zeros_like(image)
    inputs = [
        wrapped.to(torch.float64).contiguous(),
        as32(image),
        *_bounds_on(partition, device),
        wp.vec3i(*partition.grid),
        wp.vec3i(*_image_reach(partition, width)),
        wp.vec3d(*[float(h) for h in partition.geometry.heights]),
        float(width),
        int(exclude),
        as32(own_rank) if exclude else torch.zeros(n, dtype=torch.int32, device=device),
        as32(home),
    ]
    if packs_in_order(device):
        per_atom, besides = PACKED_IMAGES_ROOM
        outputs = _image_outputs(per_atom * n + besides, device)
        offsets, total = launch_packed(warp_kernel("images_near_bricks_packed", _GEOMETRY), n, device, inputs, outputs)
        if total <= outputs[0].shape[0]:
            atom, rank, shift, distance = (x[:total] for x in outputs)
            return ImageSet(atom=atom, rank=rank, shift=shift.to(torch.int64), distance=distance)
    else:
        counts = torch.zeros(n, dtype=torch.int32, device=device)
        launch(warp_kernel("images_near_bricks_count", _GEOMETRY), n, device, inputs, [counts[:0], *_image_outputs(0, device), counts])
        offsets = torch.zeros(n + 1, dtype=torch.int32, device=device)
        torch.cumsum(counts, 0, out=offsets[1:])
    atom, rank, shift, distance = _image_outputs(int(offsets[-1]), device)
    launch(warp_kernel("images_near_bricks_fill", _GEOMETRY), n, device, inputs, [offsets, atom, rank, shift, distance, offsets[:0]])
    return ImageSet(atom=atom, rank=rank, shift=shift.to(torch.int64), distance=distance)


PACKED_IMAGES_ROOM = (4, 4096)
"""Images an atom that the packed pass of :func:`_warp_images_near_bricks` has room for on average, and how many more in all.

LJ 32k on one rank has 0.62 images an atom, the demo composite 8k 1.5 (its
11 Å halo); smaller bricks have more. Should they outnumber the room, one
more pass writes them (as on a GPU), so the sizing costs time, never images.
Measured against the count and write passes (one AMD EPYC thread, the same
images): LJ 32k 1.54 -> 1.20 ms, the demo composite 0.75 -> 0.50 ms.
"""


def _image_outputs(count: int, device: torch.device) -> list[torch.Tensor]:
    """Empty outputs for ``count`` images: atom, rank, shift and distance."""
    i64 = lambda: torch.empty(count, dtype=torch.int64, device=device)  # noqa: E731
    return [i64(), i64(), torch.empty(count, 3, dtype=torch.int32, device=device), torch.empty(count, dtype=torch.float64, device=device)]


def _pack_axis(inside: torch.Tensor, excess: torch.Tensor, n_img: torch.Tensor):
    """Move each atom's valid (brick, image) candidates to the front.

    Returns ``valid (N, K)``, ``brick (N, K)``, ``image (N, K)`` and
    ``excess (N, K)`` where K is the largest number of candidates of any atom.
    """
    n, p, i = inside.shape
    flat = inside.reshape(n, p * i)
    order = torch.argsort((~flat).to(torch.int8), dim=1, stable=True)
    k = max(int(flat.sum(dim=1).max()) if n else 0, 1)
    order = order[:, :k]
    valid = torch.gather(flat, 1, order)
    brick = order // i
    image = n_img[order % i]
    ex = torch.gather(excess.reshape(n, p * i), 1, order)
    return valid, brick, image, ex
