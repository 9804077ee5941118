"""Smooth PME: agreement with Ewald, conformance, wiring, mesh and B-spline details.

(The emulated domain-decomposition test of PME lives with Ewald's in test_ewald.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
from torchpme.lib import MeshInterpolator

from halopipe.models.charges import ChargeModel
from halopipe.models.ewald import Ewald
from halopipe.models.pme import PME, bspline_influence, mesh_size
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System
from halopipe.testing import check_model, finite_difference_forces, finite_difference_stress

from ..conftest import random_ionic_cell

pytestmark = pytest.mark.timeout(180)


def evaluate(model, system: System, stress: bool = False) -> dict:
    return Pipeline([Group([Step(model)], autograd=True)])(system, stress=stress)


def max_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest row error relative to the largest row norm."""
    if got.ndim == 1:
        got, want = got[None], want[None]
    return float((got - want).norm(dim=-1).max() / want.norm(dim=-1).max())


# ------------------------------------------------------------ against Ewald
def test_matches_ewald_at_tight_setting():
    """Fine mesh, order 5: PME reproduces a converged Ewald sum with the same alpha (forces within 1e-5 relative)."""
    system = random_ionic_cell(n_cells=3, seed=11, net_charge=0.6)
    ewald = Ewald(cutoff=6.0, accuracy=1e-12)
    pme = PME(cutoff=6.0, accuracy=1e-12, alpha=ewald.alpha, order=5, mesh_spacing=0.08 / ewald.alpha)
    ref, out = evaluate(ewald, system, stress=True), evaluate(pme, system, stress=True)
    assert max_relative(out["forces"], ref["forces"]) < 1e-5
    assert float(out["energy"]) == pytest.approx(float(ref["energy"]), rel=1e-6)
    assert float((out["stress"] - ref["stress"]).abs().max()) < 1e-5 * float(ref["stress"].abs().max())


@pytest.mark.parametrize("order", [4, 5])
def test_default_mesh_meets_requested_accuracy(order):
    """With the default mesh for an accuracy, forces agree with a converged Ewald sum to a small multiple of it."""
    system = random_ionic_cell(n_cells=3, seed=12)
    ref = evaluate(Ewald(cutoff=6.0, accuracy=1e-13), system)
    for accuracy in (1e-4, 1e-5):
        out = evaluate(PME(cutoff=6.0, accuracy=accuracy, order=order), system)
        assert max_relative(out["forces"], ref["forces"]) < 4 * accuracy  # measured 1.4-2.3x


def test_explicit_mesh_size_is_used_and_converges_to_ewald():
    """An explicit mesh is taken as given, and refining it converges to a converged Ewald sum at the B-spline order's rate."""
    system = random_ionic_cell(n_cells=3, seed=13)
    ewald = Ewald(cutoff=6.0, accuracy=1e-12)
    ref = evaluate(ewald, system)
    errors = []
    for n in (16, 24, 48):
        pme = PME(cutoff=6.0, accuracy=1e-12, alpha=ewald.alpha, order=5, mesh_size=(n, n, n))
        assert pme.mesh(system.cell) == [n, n, n]
        errors.append(max_relative(evaluate(pme, system)["forces"], ref["forces"]))
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-5  # measured 5.3e-6
    assert errors[1] / errors[2] > 2**4  # halving the spacing at order 5: measured 43x


# -------------------------------------------------------------- conformance
@pytest.mark.parametrize("order, spacing, atol", [(3, 0.1, 1e-4), (4, 0.15, 5e-5), (5, 0.15, 1e-6)])
def test_check_model(order, spacing, atol):
    """Finite-difference forces and stress are exact; translation invariance only up to the mesh error.

    A mesh breaks continuous translation symmetry (the net force is not zero
    but of the order of the discretisation error), so the identity tolerance
    ``atol`` of check_model is set per order from the mesh used.
    """
    system = random_ionic_cell(n_cells=2, seed=14, net_charge=0.5)
    report = check_model(PME(cutoff=5.0, accuracy=1e-6, order=order, mesh_spacing=spacing), system, atol=atol)
    assert report["forces_vs_finite_differences"] < 1e-8 and report["stress_vs_finite_differences"] < 1e-9


def test_rotation_is_exact_and_net_force_vanishes_with_the_mesh():
    """The mesh follows the lattice vectors, so a rigid rotation of atoms and cell is an exact symmetry."""
    from halopipe.testing import random_rotation

    system = random_ionic_cell(n_cells=2, seed=17, net_charge=0.5)
    model = PME(cutoff=5.0, accuracy=1e-6, order=4, mesh_spacing=0.3)
    rot = random_rotation(3)
    ref = evaluate(model, system)
    rotated = evaluate(model, system.replace(positions=system.positions @ rot.T, cell=system.cell @ rot.T))
    assert float(rotated["energy"]) == pytest.approx(float(ref["energy"]), rel=1e-12)
    torch.testing.assert_close(rotated["forces"], ref["forces"] @ rot.T, rtol=0, atol=1e-10)
    net = [float(evaluate(PME(cutoff=5.0, order=4, mesh_spacing=h), system)["forces"].sum(0).norm()) for h in (0.3, 0.15)]
    assert net[1] < net[0] / 8  # ~h^4 for cubic B-splines


def test_wired_charges_forces_and_stress():
    system = random_ionic_cell(n_cells=2, seed=15).replace(fields={})
    charge_model = ChargeModel(cutoff=4.0, coordination_weight=0.05, total_charge=-0.2)
    pipe = Pipeline([Group([Step(charge_model), Step(PME(cutoff=5.0, accuracy=1e-6, mesh_spacing=0.3))])])
    out = pipe(system, stress=True)
    atoms = [1, 4, 6]
    torch.testing.assert_close(out["forces"][atoms], finite_difference_forces(pipe, system, atoms), rtol=0, atol=1e-6)
    torch.testing.assert_close(out["stress"], finite_difference_stress(pipe, system), rtol=0, atol=1e-7)


# ---------------------------------------------------------- B-spline factor
@pytest.mark.parametrize("order", [3, 4, 5])
def test_bspline_influence_matches_torchpme_spreading(order):
    """1/|b(m)|^2 equals 1/|FFT|^2 of a unit charge spread on a mesh node by torch-pme's B-spline interpolator."""
    n = 12
    cell = torch.eye(3, dtype=torch.float64) * 7.0
    interp = MeshInterpolator(cell, torch.tensor([n, n, n]), interpolation_nodes=order, method="P3M")
    interp.compute_weights(torch.zeros(1, 3, dtype=torch.float64))
    rho = interp.points_to_mesh(torch.ones(1, 1, dtype=torch.float64))[0]
    want = 1.0 / torch.fft.rfftn(rho).abs() ** 2
    got = (
        bspline_influence(n, order, False, torch.float64, "cpu")[:, None, None]
        * bspline_influence(n, order, False, torch.float64, "cpu")[None, :, None]
        * bspline_influence(n, order, True, torch.float64, "cpu")[None, None, :]
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_mesh_size_is_fft_friendly():
    cell = torch.diag(torch.tensor([7.0, 10.0, 13.3], dtype=torch.float64))
    for n, length in zip(mesh_size(cell, 0.5, 4), (7.0, 10.0, 13.3)):
        assert n >= math.ceil(length / 0.5)
        m = n
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        assert m == 1


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs",
    [
        {"order": 2},
        {"order": 6},
        {"mesh_spacing": -0.1},
        {"mesh_size": (8, 8)},
        {"mesh_size": (2, 8, 8)},
        {"accuracy": 0.0},
        {"cutoff": -1.0},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        PME(**{"cutoff": 5.0, **kwargs})


def test_non_periodic_and_oversized_mesh_are_rejected():
    system = random_ionic_cell(n_cells=2, seed=16)
    with pytest.raises(ValueError, match="periodic along all three axes"):
        evaluate(PME(cutoff=5.0), system.replace(pbc=torch.tensor([True, False, True])))
    with pytest.raises(ValueError, match="exceeds"):
        evaluate(PME(cutoff=5.0, mesh_spacing=0.01), system)
