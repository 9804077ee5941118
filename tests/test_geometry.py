"""Bricks, images near bricks and the slab metric against brute force and ASE's neighbour list."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from ase.neighborlist import neighbor_list

from halopipe import geometry as geometry_module
from halopipe.geometry import Geometry, Partition, choose_grid, images_near_bricks
from halopipe.kernels import backend as kernel_backend_module
from halopipe.kernels import pairs as pair_kernels

from .conftest import triclinic_nacl


def _slab_distance(point: np.ndarray, reciprocal: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    """Largest, over axes, Cartesian distance of ``point`` outside the slab between two lattice planes.

    Computed from the point's projection on the unit reciprocal vectors (an independent route to
    the fractional-coordinate arithmetic of ``halopipe.geometry``).
    """
    worst = 0.0
    for a in range(3):
        unit = reciprocal[a] / np.linalg.norm(reciprocal[a])
        height = 1.0 / np.linalg.norm(reciprocal[a])
        s = point @ unit
        worst = max(worst, lo[a] * height - s, s - hi[a] * height)
    return max(worst, 0.0)


def brute_force_images(positions: np.ndarray, cell: np.ndarray, grid, width: float) -> dict:
    """(atom, brick rank, shift) -> slab distance for every image within ``width`` of a brick, by explicit loops."""
    reciprocal = np.linalg.inv(cell).T
    reach = int(np.ceil(width * np.linalg.norm(reciprocal, axis=1).max())) + 2  # lattice planes within the width, and margin
    found = {}
    for i, r in enumerate(positions):
        for shift in itertools.product(range(-reach, reach + 1), repeat=3):
            image = r + np.array(shift) @ cell
            for brick in itertools.product(*(range(p) for p in grid)):
                lo = np.array([brick[a] / grid[a] for a in range(3)])
                hi = np.array([(brick[a] + 1) / grid[a] for a in range(3)])
                d = _slab_distance(image, reciprocal, lo, hi)
                if d <= width:
                    rank = brick[0] * grid[1] * grid[2] + brick[1] * grid[2] + brick[2]
                    found[(i, rank, shift)] = d
    return found


@pytest.mark.parametrize("grid, width", [((1, 1, 1), 4.0), ((2, 3, 1), 3.0), ((2, 1, 2), 9.5)])
def test_images_near_bricks_equal_brute_force(backend, grid, width):
    system = triclinic_nacl(repeat=(1, 1, 1), seed=4)
    part = Partition.build(grid, system.cell, system.pbc)
    wrapped, image = part.wrap(part.geometry.fractional(system.positions))
    got = images_near_bricks(part, wrapped, image, width)
    mine = {(int(a), int(r), tuple(s.tolist())): float(d) for a, r, s, d in zip(got.atom, got.rank, got.shift, got.distance)}
    want = brute_force_images(system.positions.numpy(), system.cell.numpy(), grid, width)
    assert mine.keys() == want.keys()
    assert max(abs(mine[k] - want[k]) for k in want) < 1e-12


def test_every_pair_within_the_width_is_among_the_images_of_one_brick(backend):
    """Slab metric is a superset of Euclidean distance: ASE's pairs (i inside the brick) all appear."""
    system = triclinic_nacl(repeat=(2, 1, 1), seed=5)
    width = 6.5
    part = Partition.build((1, 1, 1), system.cell, system.pbc)
    wrapped, image = part.wrap(part.geometry.fractional(system.positions))
    got = images_near_bricks(part, wrapped, image, width)
    listed = {(int(a), tuple(s.tolist())) for a, s in zip(got.atom, got.shift)}
    listed |= {(i, (0, 0, 0)) for i in range(system.n_atoms)}  # the atoms themselves
    atoms_positions = (system.positions + (-image.to(system.dtype)) @ system.cell).numpy()  # every atom inside the cell
    i, j, shifts = neighbor_list("ijS", _ase_atoms(system, atoms_positions), width)
    # j's image seen from the wrapped i is atoms_positions[j] + S @ cell = stored r_j + (S - image_j) @ cell.
    missing = [(int(b), tuple(int(x) for x in (s - image[b].numpy()))) for b, s in zip(j, shifts)]
    assert len(i) > 100  # 4 atoms with ~34 neighbours each
    assert not [m for m in missing if m not in listed]


def _with_kernels(kind: str, monkeypatch, compute):
    """``compute()`` with the kernel technology ``kind`` ("warp" or "torch")."""
    monkeypatch.setenv("HALOPIPE_KERNELS", kind)
    kernel_backend_module.warp_module.cache_clear()
    pair_kernels.warp_kernel.cache_clear()
    try:
        assert (pair_kernels.warp_kernel("images_near_bricks_fill", "_warp_geometry") is not None) == (kind == "warp")
        return compute()
    finally:
        kernel_backend_module.warp_module.cache_clear()
        pair_kernels.warp_kernel.cache_clear()


def _partitioned(system, grid):
    """``system``'s partition into ``grid`` bricks (open axes spanning the atoms), its wrapped atoms, images and owners."""
    lo = hi = None
    if not bool(system.pbc.all()):
        frac = Geometry(system.cell, system.pbc).fractional(system.positions)
        lo, hi = frac.min(dim=0).values, frac.max(dim=0).values
    part = Partition.build(grid, system.cell, system.pbc, lo, hi)
    wrapped, image = part.wrap(part.geometry.fractional(system.positions))
    return part, wrapped, image, part.rank_of(part.brick_index(wrapped))


WARP_IMAGE_PASSES = ["packed", "packed_past_its_outputs", "count_and_fill"]
"""The Warp images' paths: one packed pass (the CPU), with the write pass after it where the images outnumber
its outputs, and a GPU's count then write."""


def _take_image_pass(warp_pass: str, monkeypatch) -> None:
    if warp_pass == "packed_past_its_outputs":
        monkeypatch.setattr(geometry_module, "PACKED_IMAGES_ROOM", (0, 0))
    elif warp_pass == "count_and_fill":
        monkeypatch.setattr(pair_kernels, "PACK_IN_ORDER", False)


@pytest.mark.parametrize("warp_pass", WARP_IMAGE_PASSES)
@pytest.mark.parametrize(
    "grid, width, pbc", [((2, 1, 2), 9.5, (True, True, True)), ((2, 2, 1), 5.0, (True, False, True)), ((3, 1, 1), 12.0, (False,) * 3)]
)
def test_warp_images_and_nearest_images_equal_the_torch_ones_bit_for_bit(monkeypatch, grid, width, pbc, warp_pass):
    """The halo plan's geometry is the same, in the same order, with either kernel technology (owned images left out too)."""
    _take_image_pass(warp_pass, monkeypatch)
    system = triclinic_nacl(repeat=(2, 1, 1), seed=4).replace(pbc=torch.tensor(pbc))
    part, wrapped, image, owner = _partitioned(system, grid)
    g = torch.Generator().manual_seed(0)
    bricks = torch.stack([torch.randint(0, p, (system.n_atoms,), generator=g) for p in grid], dim=1)

    def geometry():
        home, outside = part.nearest_image(wrapped, part.brick_index_of_rank(owner))
        near = part.nearest_image(wrapped, bricks)
        found = [images_near_bricks(part, wrapped, image, width), images_near_bricks(part, wrapped, image, width, owner, home)]
        return [home, outside, *near] + [getattr(f, key) for f in found for key in ("atom", "rank", "shift", "distance")]

    warp, eager = _with_kernels("warp", monkeypatch, geometry), _with_kernels("torch", monkeypatch, geometry)
    assert eager[-4].numel() > 0 and eager[-4].numel() < eager[-8].numel()  # some images found, the owned ones left out
    for a, b in zip(warp, eager):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("warp_pass", WARP_IMAGE_PASSES)
@pytest.mark.parametrize("grid, pbc", [((1, 1, 1), (True, True, True)), ((2, 1, 2), (True, True, True)), ((2, 2, 1), (True, False, True))])
def test_warp_images_skip_only_atoms_that_have_none(monkeypatch, grid, pbc, warp_pass):
    """The Warp kernels skip atoms deep inside their own brick: the images stay those of the torch path, bit for bit.

    The cell is large against the width, so many atoms have no image (the skip is taken) and many have some.
    """
    _take_image_pass(warp_pass, monkeypatch)
    system = triclinic_nacl(repeat=(8, 8, 8), seed=7).replace(pbc=torch.tensor(pbc))
    part, wrapped, image, owner = _partitioned(system, grid)
    home, _ = part.nearest_image(wrapped, part.brick_index_of_rank(owner))

    def images():
        found = images_near_bricks(part, wrapped, image, 2.5, owner, home)
        return [found.atom, found.rank, found.shift, found.distance]

    warp, eager = _with_kernels("warp", monkeypatch, images), _with_kernels("torch", monkeypatch, images)
    assert 0 < torch.unique(eager[0]).numel() < 0.8 * system.n_atoms
    for a, b in zip(warp, eager):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "grid, pbc",
    [((1, 1, 1), (True, True, True)), ((2, 1, 3), (True, True, True)), ((2, 2, 1), (True, False, True)), ((3, 1, 2), (False,) * 3)],
)
def test_warp_placement_equals_the_torch_one_bit_for_bit_and_holds_each_row_in_its_brick(monkeypatch, grid, pbc):
    """``Partition.place`` (wrap, owning brick, nearest image to a rank's brick) is the same with either technology.

    Rows are spread over several cells either way (wrapping at work), and the owner's brick bounds each wrapped row.
    """
    system = triclinic_nacl(repeat=(3, 2, 2), seed=11).replace(pbc=torch.tensor(pbc))
    g = torch.Generator().manual_seed(1)
    positions = system.positions + (torch.randint(-2, 3, (system.n_atoms, 3), generator=g).to(system.dtype) @ system.cell) * system.pbc
    part, _, _, _ = _partitioned(system.replace(positions=positions), grid)
    frac = part.geometry.fractional(positions)
    ranks = range(math.prod(grid))

    def placements():
        return [[getattr(part.place(frac, r), key) for key in ("wrapped", "image", "owner", "home", "outside")] for r in ranks]

    warp, eager = _with_kernels("warp", monkeypatch, placements), _with_kernels("torch", monkeypatch, placements)
    for per_rank_warp, per_rank_eager in zip(warp, eager):
        for a, b in zip(per_rank_warp, per_rank_eager):
            assert a.dtype == b.dtype and torch.equal(a, b)
    wrapped, image, owner = eager[0][:3]
    assert bool((image != 0).any()) == bool(system.pbc.any())
    assert torch.allclose(wrapped + image, frac, rtol=0.0, atol=1e-14)  # wrapping moves rows by whole lattice vectors only
    brick = part.brick_index_of_rank(owner)
    for a in range(3):
        lo, hi = part.bounds[a][brick[:, a]], part.bounds[a][brick[:, a] + 1]
        assert bool(((lo <= wrapped[:, a]) & (wrapped[:, a] < hi) | (hi == 1.0) & (wrapped[:, a] == 1.0)).all())
    for r in ranks:  # a row's home image lies in the rank's brick exactly when it is 0 Å outside it
        home, outside = eager[r][3:]
        inside = torch.ones(len(outside), dtype=torch.bool)
        mine = part.brick_index_of_rank(torch.tensor([r]))[0]
        for a in range(3):
            x = wrapped[:, a] + home[:, a]
            inside &= (part.bounds[a][mine[a]] <= x) & (x <= part.bounds[a][mine[a] + 1])
        assert torch.equal(inside, outside == 0)


def _ase_atoms(system, positions):
    from ase import Atoms

    return Atoms(numbers=system.numbers.numpy(), positions=positions, cell=system.cell.numpy(), pbc=system.pbc.numpy())


def test_nearest_image_is_the_closest_candidate(backend):
    system = triclinic_nacl(repeat=(1, 1, 1), seed=6)
    grid = (3, 2, 1)
    part = Partition.build(grid, system.cell, system.pbc)
    wrapped, _ = part.wrap(part.geometry.fractional(system.positions))
    reciprocal = np.linalg.inv(system.cell.numpy()).T
    g = torch.Generator().manual_seed(0)
    bricks = torch.stack([torch.randint(0, p, (system.n_atoms,), generator=g) for p in grid], dim=1)
    images, dist = part.nearest_image(wrapped, bricks)
    cell = system.cell.numpy()
    for k in range(system.n_atoms):
        lo = np.array([bricks[k, a].item() / grid[a] for a in range(3)])
        hi = np.array([(bricks[k, a].item() + 1) / grid[a] for a in range(3)])
        shifts = itertools.product((-1, 0, 1), repeat=3)
        candidates = {s: _slab_distance((wrapped[k].numpy() + np.array(s)) @ cell, reciprocal, lo, hi) for s in shifts}
        best = min(candidates.values())
        assert float(dist[k]) == pytest.approx(best, abs=1e-12)
        assert candidates[tuple(images[k].tolist())] == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize(
    "lengths, world, want",
    [
        ((20.0, 20.0, 20.0), 8, (2, 2, 2)),
        ((40.0, 10.0, 10.0), 4, (4, 1, 1)),
        ((30.0, 30.0, 10.0), 4, (2, 2, 1)),
        ((10.0, 10.0, 70.0), 7, (1, 1, 7)),
        ((20.0, 20.0, 20.0), 2, (2, 1, 1)),  # ties: the first axes, as the mesh FFT splits them
        ((20.0, 20.0, 20.0), 4, (2, 2, 1)),
        ((30.0, 10.0, 30.0), 2, (2, 1, 1)),
        ((10.0, 30.0, 30.0), 2, (1, 2, 1)),
    ],
)
def test_choose_grid_minimises_brick_surface(lengths, world, want):
    """Analytic optima: equal bricks for a cube, slices across the long axis, no cut along a short one."""
    cell = torch.diag(torch.tensor(lengths, dtype=torch.float64))
    assert choose_grid(world, cell, torch.tensor([True, True, True])) == want


@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_a_cubic_cells_bricks_split_the_axes_its_mesh_fft_splits(world):
    """On a cube, the bricks split the mesh axes that the FFT's process grid splits (slabs: axis 0; pencils: 0 and 1).

    Then a rank's box of mesh points (its brick's, plus a ghost layer) lies
    mostly in its own FFT block instead of across all of them.
    """
    from halopipe.distributed.fft import choose_grid as fft_grid

    cell = torch.diag(torch.tensor([30.0, 30.0, 30.0], dtype=torch.float64))
    rows, columns = fft_grid((48, 48, 48), world)
    assert choose_grid(world, cell, torch.tensor([True, True, True])) == (rows, columns, 1)
