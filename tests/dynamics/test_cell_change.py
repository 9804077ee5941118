"""A changing cell under domain decomposition: forces stay exact, the plan is rebuilt only when the strain needs it.

The reference is a fresh single-process evaluation of the strained system.
``strain_displacement`` counts a strain ``e`` as a displacement of ``e * reach / 2``
(reach = halo + 1.5 skin): with LJ (cutoff 6 Å) and skin 1 Å the reach is 7.5 Å,
so compressing by 13 % (0.4875 Å) keeps the plan and 15 % (0.5625 Å) rebuilds it.
A 13 % compression keeps it right: a pair beyond 7 Å before is beyond 6.09 Å after.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halopipe import Ewald, Pipeline, System
from halopipe.distributed.launch import spawn
from halopipe.domain import strain_displacement

from ..conftest import triclinic_nacl
from ._npt_workers import strained_forces
from ._workers import argon, lj

SCALES = [0.87, 0.85]  # just inside the skin's budget, then beyond it


def _fresh(system: System, scale, model) -> dict:
    deform = scale * torch.eye(3) if isinstance(scale, float) else scale
    strained = System(positions=system.positions @ deform, numbers=system.numbers, cell=system.cell @ deform, pbc=system.pbc)
    strained.fields.update(system.fields)
    return Pipeline([model])(strained, stress=True, decompose=False)


def _check(got: list[dict], system: System, model, scales=SCALES) -> None:
    for scale, result in zip(scales, got):
        ref = _fresh(system, scale, model)
        np.testing.assert_allclose(result["forces"], ref["forces"].numpy(), rtol=0, atol=1e-10, err_msg=f"scale {scale}")
        assert abs(result["energy"] - float(ref["energy"])) <= 1e-12 * abs(float(ref["energy"]))
        np.testing.assert_allclose(result["stress"], ref["stress"].numpy(), rtol=0, atol=1e-12)


def test_strain_displacement_counts_the_largest_principal_stretch():
    cell = torch.diag(torch.tensor([10.0, 11.0, 12.0]))
    shear = torch.tensor([[1.0, 0.0, 0.0], [0.1, 1.0, 0.0], [0.0, 0.0, 1.0]])
    extra, mapping = strain_displacement(cell, cell @ shear, reach=8.0)
    stretches = torch.linalg.svdvals(torch.linalg.inv(cell) @ cell @ shear)  # of the shear alone
    assert torch.allclose(mapping, torch.linalg.inv(cell) @ cell @ shear)
    assert extra == pytest.approx(0.5 * 8.0 * max(float(stretches.max()) - 1, 1 - float(stretches.min())))
    assert strain_displacement(cell, cell, 8.0)[0] == 0.0
    assert strain_displacement(cell, cell * 1.02, 10.0)[0] == pytest.approx(0.1)


@pytest.mark.timeout(60)
def test_compressed_cell_keeps_or_rebuilds_the_plan_single_process():
    system = argon(cells=3)
    got = strained_forces(system, SCALES, skin=1.0)
    assert [g["rebuilt"] for g in got] == [False, True]
    _check(got, system, lj())


@pytest.mark.timeout(120)
def test_compressed_cell_keeps_or_rebuilds_the_plan_on_two_ranks():
    system = argon(cells=3)
    got = spawn(strained_forces, 2, system, SCALES, 1.0, timeout=100)[0]
    assert [g["rebuilt"] for g in got] == [False, True]
    _check(got, system, lj())


@pytest.mark.timeout(120)
def test_ewald_sees_the_new_cell_on_two_ranks():
    system = triclinic_nacl()
    model = Ewald(cutoff=6.0, accuracy=1e-8)
    got = spawn(strained_forces, 2, system, SCALES, 1.0, model, timeout=100)[0]
    _check(got, system, model)


@pytest.mark.timeout(120)
def test_sheared_triclinic_cell_keeps_exact_forces_on_two_ranks():
    # A 6 % shear plus 3 % stretch: principal stretches ~ 1.06 and 0.97, strain share ~0.24 Å < skin/2, plan kept.
    system = triclinic_nacl(charges=False)
    deform = torch.tensor([[1.03, 0.0, 0.0], [0.06, 1.0, 0.0], [0.0, 0.0, 1.0]])
    got = spawn(strained_forces, 2, system, [deform], 1.0, lj(), timeout=100)[0]
    assert got[0]["rebuilt"] is False
    _check(got, system, lj(), scales=[deform])
