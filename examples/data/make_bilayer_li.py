"""Writes bilayer_li.extxyz: AB bilayer graphene (16x16 in-plane, 1024 C) with 24 Li in the gallery, in vacuum.

    python examples/data/make_graphite_li.py

Li sits at hexagon centres halfway between the layers; the gallery is opened to 3.5 Å (graphite: 3.35 Å, LiC6:
3.7 Å). The binding of the two layers is almost entirely dispersion, so this is a system where D3 matters. The
cell is periodic in all three directions with 56 Å along z, so that the bilayer meets no periodic image of itself
within D3's default 50.2 Å two-body cutoff (the stress then describes the in-plane state; sigma_zz ~ 0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ase import Atoms
from ase.io import write

A, GALLERY, HEIGHT = 2.464, 3.5, 56.0


def bilayer_li(n_in_plane: int = 16, n_li: int = 24, seed: int = 0) -> Atoms:
    """AB-stacked bilayer graphene, ``n_in_plane`` x ``n_in_plane`` cells, ``n_li`` Li in the gallery."""
    cell = np.array([[A, 0, 0], [A / 2, A * np.sqrt(3) / 2, 0], [0, 0, HEIGHT]])
    z0 = (HEIGHT - GALLERY) / 2
    bottom = [[0, 0, z0], [1 / 3, 1 / 3, z0]]
    top = [[1 / 3, 1 / 3, z0 + GALLERY], [2 / 3, 2 / 3, z0 + GALLERY]]  # B layer shifted by one bond
    frac = [[x, y, z / HEIGHT] for x, y, z in bottom + top]
    atoms = Atoms("C4", scaled_positions=frac, cell=cell, pbc=True).repeat((n_in_plane, n_in_plane, 1))
    grid = np.stack(np.meshgrid(np.arange(n_in_plane), np.arange(n_in_plane), indexing="ij"), -1).reshape(-1, 2)
    hollow = (grid + 2 / 3) / n_in_plane  # above a hexagon centre of the bottom layer
    sites = hollow[np.random.default_rng(seed).choice(len(hollow), n_li, replace=False)]
    z = np.full((n_li, 1), (z0 + GALLERY / 2) / HEIGHT)
    atoms += Atoms("Li" * n_li, scaled_positions=np.hstack([sites, z]), cell=atoms.cell, pbc=True)
    return atoms


if __name__ == "__main__":
    atoms = bilayer_li()
    path = Path(__file__).with_name("bilayer_li.extxyz")
    write(path, atoms, format="extxyz")
    print(f"{len(atoms)} atoms -> {path}")
