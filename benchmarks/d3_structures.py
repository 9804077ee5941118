"""Structures for the DFT-D3 benchmarks, and the number of pairs a two-body cutoff takes in.

Every builder is seeded, so the codes compared (and successive runs) see the
same atoms. Besides argon (one element, one reference coordination number),
the structures cover elements with several D3 reference coordination numbers
and mixed-element pairs:

* ``si-512``, ``si-4k``: diamond silicon, 4 x 4 x 4 and 8 x 8 x 8 conventional
  cells (a = 5.43 Å), rattled by 0.05 Å.
* ``urea-432``, ``urea-3456``: the urea molecular crystal (C/H/N/O; P-42_1m,
  a = 5.565 Å, c = 4.684 Å, 2 molecules per cell, 1.32 g/cm³), 3 x 3 x 3 and
  6 x 6 x 6 cells, rattled by 0.02 Å (molecules stay intact).
* ``rutile-576``, ``rutile-4608``: rutile TiO2 (P4_2/mnm, a = 4.594 Å,
  c = 2.959 Å, u = 0.3048), 4 x 4 x 6 and 8 x 8 x 12 cells, rattled by 0.05 Å.
* ``rutile-slab-432``: a four-layer rutile (110) slab, 3 x 6 surface cells,
  with 15 Å of vacuum along z (periodic in all three directions, as s-dftd3
  is given it), rattled by 0.05 Å.
* ``rutile-triclinic-72``: rutile 2 x 2 x 3 (72 atoms) sheared into a
  triclinic cell (angles 80°, 96°, 104°; fractional coordinates kept), rattled
  by 0.05 Å: a small skewed cell, where periodic images dominate the pairs.
"""

from __future__ import annotations

import itertools

import numpy as np
from ase import Atoms
from ase.build import bulk, surface
from ase.geometry import cellpar_to_cell
from ase.spacegroup import crystal

# Urea (Swaminathan, Craven & McMullan 1984, neutron): C, O, N, H(anti), H(syn) in space group 113.
UREA_BASIS = [(0.0, 0.5, 0.3260), (0.0, 0.5, 0.5953), (0.1459, 0.6459, 0.1766), (0.2575, 0.7575, 0.2827), (0.1441, 0.6441, -0.0380)]
UREA_CELL = [5.565, 5.565, 4.684, 90.0, 90.0, 90.0]


def _rattled(atoms: Atoms, scale: float, seed: int) -> Atoms:
    atoms.positions += np.random.default_rng(seed).normal(scale=scale, size=atoms.positions.shape)
    return atoms


def _urea(repeat: int) -> Atoms:
    cell = crystal(["C", "O", "N", "H", "H"], UREA_BASIS, spacegroup=113, cellpar=UREA_CELL)
    return _rattled(cell.repeat((repeat,) * 3), 0.02, 2)


def _rutile() -> Atoms:
    return crystal(["Ti", "O"], [(0.0, 0.0, 0.0), (0.3048, 0.3048, 0.0)], spacegroup=136, cellpar=[4.594, 4.594, 2.959, 90, 90, 90])


def _rutile_slab() -> Atoms:
    slab = surface(_rutile(), (1, 1, 0), 4, vacuum=7.5).repeat((3, 6, 1))  # 7.5 Å either side: a 15 Å gap between images
    slab.pbc = True
    return _rattled(slab, 0.05, 4)


def _rutile_triclinic() -> Atoms:
    atoms = _rutile().repeat((2, 2, 3))
    lengths = atoms.cell.lengths()
    atoms.set_cell(cellpar_to_cell([*lengths, 80.0, 96.0, 104.0]), scale_atoms=True)
    return _rattled(atoms, 0.05, 5)


STRUCTURES = {
    # the original d3 row: the same positions as before this module existed (seed 0, 0.05 Å)
    "ar-864": lambda: _rattled(bulk("Ar", "fcc", a=5.26, cubic=True).repeat((6, 6, 6)), 0.05, 0),
    "si-512": lambda: _rattled(bulk("Si", "diamond", a=5.43, cubic=True).repeat((4, 4, 4)), 0.05, 1),
    "si-4k": lambda: _rattled(bulk("Si", "diamond", a=5.43, cubic=True).repeat((8, 8, 8)), 0.05, 1),
    "urea-432": lambda: _urea(3),
    "urea-3456": lambda: _urea(6),
    "rutile-576": lambda: _rattled(_rutile().repeat((4, 4, 6)), 0.05, 3),
    "rutile-4608": lambda: _rattled(_rutile().repeat((8, 8, 12)), 0.05, 3),
    "rutile-slab-432": _rutile_slab,
    "rutile-triclinic-72": _rutile_triclinic,
}


def build(name: str) -> Atoms:
    """The structure ``name`` (a key of :data:`STRUCTURES`), periodic in all three directions."""
    return STRUCTURES[name]()


def pairs_within(positions: np.ndarray, cell: np.ndarray, cutoff: float) -> int:
    """Distinct pairs (i, j, periodic image) closer than ``cutoff``: the two-body terms a D3 energy sums.

    An exact lattice sum over every image that can hold a partner (the
    count is the cost model of the cutoff sweep, so no estimate from the
    density), in O(N² x images) numpy work: fine for a few hundred atoms.
    """
    frac = np.linalg.solve(cell.T, positions.T).T
    wrapped = (frac - np.floor(frac)) @ cell  # in the cell, so image ranges follow from the cell's widths
    diff = wrapped[None, :, :] - wrapped[:, None, :]
    widths = abs(np.linalg.det(cell)) / np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)
    reach = [int(np.ceil(cutoff / w)) + 1 for w in widths]
    ordered = 0
    for shift in itertools.product(*(range(-n, n + 1) for n in reach)):
        d2 = ((diff + np.asarray(shift, dtype=float) @ cell) ** 2).sum(-1)
        ordered += int((d2 < cutoff**2).sum())
    return (ordered - len(positions)) // 2  # drop each atom's distance to itself, count each pair once
