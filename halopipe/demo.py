"""The demo system and composite: a molten-salt-like NaCl box and its composite potential.

Used by the ``nacl`` generator of run configurations, by ``halopipe demo``
(:mod:`halopipe.cli.demo`), by tests and by benchmarks.

The composite is the one halopipe is built for: a charge model whose charges
are wired into damped-shifted-force electrostatics (autograd group, with the
cross-model chain term) plus a Lennard-Jones repulsion/dispersion evaluated
with direct forces.
"""

from __future__ import annotations

import numpy as np
import torch

from .models import ChargeModel, DSFCoulomb, LennardJones
from .pipeline import Group, Pipeline, Step
from .system import System

__all__ = ["demo_system", "demo_pipeline", "cells_for_atoms"]

NA, CL = 11, 17


def cells_for_atoms(n_atoms: int) -> int:
    """Conventional rock-salt cells per edge giving about ``n_atoms`` atoms (8 per cell)."""
    return max(1, round((n_atoms / 8) ** (1 / 3)))


def demo_system(cells: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64, rattle: float = 0.25) -> System:
    """A rattled rock-salt NaCl box of ``8 * cells**3`` atoms in a slightly triclinic cell, with formal charges."""
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((cells, cells, cells))
    rng = np.random.default_rng(seed)
    atoms.positions += rng.normal(scale=rattle, size=atoms.positions.shape)
    shear = np.eye(3) + np.array([[0.0, 0.02, 0.01], [0.0, 0.0, 0.015], [0.0, 0.0, 0.0]])
    atoms.set_cell(atoms.cell.array @ shear, scale_atoms=True)
    atoms.wrap()
    atoms.set_initial_charges(np.where(atoms.numbers == NA, 1.0, -1.0))  # formal charges, for static-charge models
    return System.from_ase(atoms, dtype=dtype)


def demo_pipeline(lj_cutoff: float = 8.0, coulomb_cutoff: float = 10.0, charge_cutoff: float = 4.0) -> Pipeline:
    """ChargeModel -> DSFCoulomb (wired, autograd) + LennardJones (direct)."""
    lj = LennardJones(epsilon={NA: 0.0115, CL: 0.0043}, sigma={NA: 2.0, CL: 3.4}, cutoff=lj_cutoff)
    charges = ChargeModel(cutoff=charge_cutoff, coordination_weight=0.02)
    coulomb = DSFCoulomb(cutoff=coulomb_cutoff, alpha=0.2)
    return Pipeline(
        [Group([Step(lj)], autograd=False), Group([Step(charges), Step(coulomb)], autograd=True)],
    )
