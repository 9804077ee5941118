"""Shared fixtures: small float64 systems built with ASE."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halopipe import System
from halopipe.kernels import backend as kernel_backend_module
from halopipe.kernels import pairs as pair_kernels
from halopipe.models.base import default_dtype

torch.set_default_dtype(torch.float64)


def triclinic_nacl(repeat=(2, 2, 2), seed: int = 0, rattle: float = 0.15, charges: bool = True) -> System:
    """A rattled rock-salt NaCl box in a triclinic cell, with formal charges."""
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64).repeat(repeat)
    atoms.rattle(rattle, seed=seed)
    atoms.set_cell(atoms.cell.array + np.array([[0, 0.3, 0.2], [0.5, 0, 0], [0.1, 0.7, 0]]), scale_atoms=True)
    if charges:
        atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def cluster(n: int = 30, seed: int = 0, species=(11, 17), box: float = 9.0, charges: bool = True) -> System:
    """A random non-periodic cloud with a minimum separation of ~1.8 Å."""
    rng = np.random.default_rng(seed)
    pts = []
    while len(pts) < n:
        p = rng.uniform(0, box, 3)
        if all(np.linalg.norm(p - q) > 1.8 for q in pts):
            pts.append(p)
    numbers = np.array([species[i % len(species)] for i in range(n)])
    fields = {"charges": torch.tensor(np.where(numbers == species[0], 1.0, -1.0))} if charges else {}
    return System(positions=torch.tensor(np.array(pts)), numbers=torch.tensor(numbers), fields=fields)


def random_ionic_cell(n_cells: int = 2, seed: int = 0, net_charge: float = 0.4, spacing: float = 2.6) -> System:
    """Jittered simple-cubic lattice of random charges (net ``net_charge``) in a strained (triclinic) cell."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(n_cells)] * 3, indexing="ij"), -1).reshape(-1, 3).astype(float)
    frac = (grid + 0.5 + rng.uniform(-0.2, 0.2, grid.shape)) / n_cells
    cell = spacing * n_cells * (np.eye(3) + rng.uniform(-0.12, 0.12, (3, 3)))
    n = len(frac)
    q = rng.normal(size=n)
    q += (net_charge - q.sum()) / n
    numbers = rng.choice([11, 17], size=n)
    return System(
        positions=torch.tensor(frac @ cell),
        numbers=torch.tensor(numbers),
        cell=torch.tensor(cell),
        pbc=[True] * 3,
        fields={"charges": torch.tensor(q)},
    )


@pytest.fixture
def nacl() -> System:
    return triclinic_nacl()


@pytest.fixture
def molecule_cloud() -> System:
    return cluster()


@pytest.fixture
def float32_default():
    """torch's own default dtype, as a user's script has it (the tests run under float64, set above)."""
    with default_dtype(torch.float32):
        yield


@pytest.fixture(params=["warp", "torch"])
def backend(request, monkeypatch):
    """Run a test once with each kernel technology (Warp skipped where it does not load)."""
    monkeypatch.setenv("HALOPIPE_KERNELS", request.param)
    kernel_backend_module.warp_module.cache_clear()
    pair_kernels.warp_kernel.cache_clear()
    if request.param == "warp" and pair_kernels.warp_kernel("lj_owned_rows") is None:
        pytest.skip("NVIDIA Warp is not available here")
    yield request.param
    kernel_backend_module.warp_module.cache_clear()
    pair_kernels.warp_kernel.cache_clear()
