"""B-spline mesh kernels (PME spreading and interpolation): Warp and eager torch against independent references.

References: torch-pme's ``MeshInterpolator`` (``"P3M"``, orders 1-5) through
plain torch autograd, and for every order the truncated-power formula of the
cardinal B-spline, ``M_p(y) = sum_k (-1)^k C(p, k) (y - k)_+^(p-1) / (p-1)!``,
also through autograd.
"""

from __future__ import annotations

import math

import pytest
import torch
from torchpme.lib import MeshInterpolator

from halopipe import PME, ChargeModel, Group, Pipeline, Step
from halopipe.kernels import backend as kernel_backend_module
from halopipe.kernels import mesh as mesh_kernels
from halopipe.kernels import pairs as pair_kernels
from halopipe.kernels.mesh import SplineBox, interpolate_mesh, mesh_coordinates, spread_charges, support_start
from halopipe.testing import check_model, finite_difference_forces, finite_difference_stress

from .conftest import random_ionic_cell

pytestmark = pytest.mark.timeout(300)

SIZES = (12, 14, 10)


@pytest.fixture(params=["warp", "torch"])
def backend(request, monkeypatch):
    """Run a test once with each kernel technology (Warp skipped where it does not load)."""
    monkeypatch.setenv("HALOPIPE_KERNELS", request.param)
    _clear_kernel_caches()
    if request.param == "warp" and mesh_kernels.compiled_kernels(5) is None:
        pytest.skip("NVIDIA Warp is not available here")
    yield request.param
    _clear_kernel_caches()


def _clear_kernel_caches() -> None:
    """Forget the loaded kernels, so that the next call reads HALOPIPE_KERNELS again (PME also runs the pair kernels)."""
    kernel_backend_module.warp_module.cache_clear()
    mesh_kernels.compiled_kernels.cache_clear()
    pair_kernels.warp_kernel.cache_clear()


def _inputs(n: int = 40, seed: int = 0):
    """A triclinic cell, positions partly outside it (unwrapped), charges and a mesh of random values."""
    gen = torch.Generator().manual_seed(seed)
    cell = torch.tensor([[7.0, 0.3, 0.1], [0.2, 8.0, -0.4], [0.0, 0.5, 6.5]], dtype=torch.float64)
    positions = (torch.rand(n, 3, generator=gen, dtype=torch.float64) * 1.4 - 0.2) @ cell
    q = torch.randn(n, generator=gen, dtype=torch.float64)
    mesh = torch.randn(SIZES, generator=gen, dtype=torch.float64)
    atom_weights = torch.randn(n, generator=gen, dtype=torch.float64)
    return cell, positions, q, mesh, atom_weights


def _objective(spread, interpolate, cell, positions, q, mesh, atom_weights, probe):
    """A scalar through both operations: ``probe . spread(q) + weights . interpolate(mesh)``, and its gradients."""
    leaves = [x.clone().requires_grad_(True) for x in (cell, positions, q, mesh)]
    c, r, charges, m = leaves
    value = (probe * spread(c, r, charges)).sum() + (atom_weights * interpolate(c, r, m)).sum()
    return [value.detach(), *torch.autograd.grad(value, leaves, materialize_grads=True)]  # order 1 does not depend on positions


def _kernel_ops(order, box: SplineBox | None = None):
    box = box or SplineBox(order, SIZES)

    def coordinates(c, r):
        u = mesh_coordinates(r, c, SIZES)
        return u, support_start(u, order)

    def spread(c, r, charges):
        u, first = coordinates(c, r)
        return spread_charges(u, charges, first, box)

    def interpolate(c, r, m):
        u, first = coordinates(c, r)
        return interpolate_mesh(u, m, first, box)

    return spread, interpolate


def _torchpme_ops(order):
    def interpolator(c, r):
        it = MeshInterpolator(c, torch.tensor(SIZES), interpolation_nodes=order, method="P3M")
        it.compute_weights(r)
        return it

    return (lambda c, r, q: interpolator(c, r).points_to_mesh(q[:, None])[0]), (
        lambda c, r, m: interpolator(c, r).mesh_to_points(m[None])[:, 0]
    )


def _truncated_power_bspline(y: torch.Tensor, order: int) -> torch.Tensor:
    """``M_p(y)`` by its explicit formula (differentiable; support ``0 < y < p``)."""
    total = sum((-1) ** k * math.comb(order, k) * (y - k).clamp(min=0) ** (order - 1) for k in range(order + 1))
    return total / math.factorial(order - 1)


def _formula_ops(order):
    """Spreading and interpolation with weights from the explicit formula, on every mesh point within reach."""

    def weights_and_index(c, r):
        u = torch.tensor(SIZES, dtype=r.dtype) * (r @ torch.linalg.inv(c))
        reach = torch.arange(-order, order + 1)
        nearest = torch.floor(u.detach()).long()
        g = nearest[:, None, :] + reach[None, :, None]  # (N, 2p+1, 3) candidate points
        w = _truncated_power_bspline(u[:, None, :] - g + order / 2, order) * ((u[:, None, :] - g).abs() < order / 2)
        idx = g % torch.tensor(SIZES)
        flat = (idx[:, :, None, None, 0] * SIZES[1] + idx[:, None, :, None, 1]) * SIZES[2] + idx[:, None, None, :, 2]
        w3 = w[:, :, None, None, 0] * w[:, None, :, None, 1] * w[:, None, None, :, 2]
        return w3.reshape(r.shape[0], -1), flat.reshape(r.shape[0], -1)

    def spread(c, r, charges):
        w, flat = weights_and_index(c, r)
        return (
            torch.zeros(math.prod(SIZES), dtype=r.dtype).index_add(0, flat.reshape(-1), (charges[:, None] * w).reshape(-1)).reshape(SIZES)
        )

    def interpolate(c, r, m):
        w, flat = weights_and_index(c, r)
        return (m.reshape(-1)[flat] * w).sum(dim=1)

    return spread, interpolate


def _assert_all_close(got, want, atol):
    for name, g, w in zip(["value", "d/dcell", "d/dpositions", "d/dq", "d/dmesh"], got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------------ forward and every gradient
@pytest.mark.parametrize("order", [1, 2, 3, 4, 5])
def test_matches_torchpme_with_all_gradients(backend, order):
    """Forward, and gradients to cell (stress), positions (forces), charges (dE/dq) and mesh, against torch-pme by autograd."""
    cell, positions, q, mesh, atom_weights = _inputs()
    probe = torch.randn(SIZES, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = _objective(*_kernel_ops(order), cell, positions, q, mesh, atom_weights, probe)
    want = _objective(*_torchpme_ops(order), cell, positions, q, mesh, atom_weights, probe)
    _assert_all_close(got, want, atol=1e-12)


@pytest.mark.parametrize("order", [2, 3, 4, 5, 6])
def test_matches_explicit_bspline_formula(backend, order):
    """Every order, including 6 (beyond torch-pme), against the truncated-power B-spline formula by autograd."""
    cell, positions, q, mesh, atom_weights = _inputs(seed=1)
    probe = torch.randn(SIZES, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = _objective(*_kernel_ops(order), cell, positions, q, mesh, atom_weights, probe)
    want = _objective(*_formula_ops(order), cell, positions, q, mesh, atom_weights, probe)
    _assert_all_close(got, want, atol=1e-11)  # the explicit formula cancels terms up to ~p^(p-1) / (p-1)!


@pytest.mark.parametrize("order", [3, 4, 5, 6])
def test_warp_matches_eager_torch(monkeypatch, order):
    """The compiled kernel and its eager twin give the same forward and gradients to 1e-12, on a periodic box of the mesh."""
    cell, positions, q, _, atom_weights = _inputs(seed=2)
    u = mesh_coordinates(positions, cell, SIZES)
    first = support_start(u, order).long()
    lo = tuple(int(first[:, d].min()) for d in range(3))  # may be negative: the box wraps
    extent = tuple(min(int(first[:, d].max()) - lo[d] + order, SIZES[d]) for d in range(3))
    box = SplineBox(order, SIZES, lo, extent)
    box_values = torch.randn(extent, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    probe = torch.randn(extent, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    results = {}
    for name in ("warp", "torch"):
        monkeypatch.setenv("HALOPIPE_KERNELS", name)
        _clear_kernel_caches()
        if name == "warp" and mesh_kernels.compiled_kernels(5) is None:
            pytest.skip("NVIDIA Warp is not available here")
        results[name] = _objective(*_kernel_ops(order, box), cell, positions, q, box_values, atom_weights, probe)
    _clear_kernel_caches()
    _assert_all_close(results["warp"], results["torch"], atol=1e-12)


def test_box_equals_the_whole_mesh_restricted(backend):
    """Spreading onto a wrapping box adds into the mesh exactly what whole-mesh spreading does; reading back likewise."""
    order = 5
    cell, positions, q, mesh, _ = _inputs(n=12, seed=3)
    positions = positions[:12] * 0.3  # a cluster, so that the box is smaller than the mesh
    u = mesh_coordinates(positions, cell, SIZES)
    first = support_start(u, order)
    lo = tuple(int(first[:, d].min()) for d in range(3))
    extent = tuple(min(int(first[:, d].max()) - lo[d] + order, SIZES[d]) for d in range(3))
    box = SplineBox(order, SIZES, lo, extent)
    assert math.prod(extent) < math.prod(SIZES)
    index = [(lo[d] + torch.arange(extent[d])) % SIZES[d] for d in range(3)]
    whole = spread_charges(u, q[:12], first, SplineBox(order, SIZES))
    part = spread_charges(u, q[:12], first, box)
    embedded = torch.zeros(SIZES, dtype=torch.float64)
    embedded[index[0][:, None, None], index[1][None, :, None], index[2][None, None, :]] += part
    torch.testing.assert_close(embedded, whole, rtol=0, atol=1e-14)
    read = mesh[index[0][:, None, None], index[1][None, :, None], index[2][None, None, :]]
    torch.testing.assert_close(
        interpolate_mesh(u, read, first, box), interpolate_mesh(u, mesh, first, SplineBox(order, SIZES)), rtol=0, atol=1e-14
    )


def test_float32_runs_in_eager_torch_and_agrees():
    cell, positions, q, mesh, _ = _inputs(seed=4)
    u64 = mesh_coordinates(positions, cell, SIZES)
    u32 = u64.float()
    box = SplineBox(4, SIZES)
    spread32 = spread_charges(u32, q.float(), support_start(u32, 4), box)
    phi32 = interpolate_mesh(u32, mesh.float(), support_start(u32, 4), box)
    assert spread32.dtype == phi32.dtype == torch.float32
    torch.testing.assert_close(spread32.double(), spread_charges(u64, q, support_start(u64, 4), box), rtol=0, atol=1e-5)
    torch.testing.assert_close(phi32.double(), interpolate_mesh(u64, mesh, support_start(u64, 4), box), rtol=0, atol=1e-5)


def test_no_atoms_gives_an_empty_result(backend):
    u = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
    q = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    box = SplineBox(5, SIZES, (3, 0, 0), (0, 0, 0))
    first = support_start(u, 5)
    assert spread_charges(u, q, first, box).shape == (0, 0, 0)
    phi = interpolate_mesh(u, torch.zeros(0, 0, 0, dtype=torch.float64), first, box)
    (gu,) = torch.autograd.grad(phi.sum() + 0.0 * u.sum(), u)
    assert phi.shape == (0,) and gu.shape == (0, 3)


def test_bad_input_is_refused():
    u = torch.tensor([[0.5, 0.5, 0.5], [6.0, 0.5, 0.5]], dtype=torch.float64)
    first = support_start(u, 4)
    with pytest.raises(ValueError, match="leaves the box along axis 0"):
        spread_charges(u, torch.ones(2, dtype=torch.float64), first, SplineBox(4, SIZES, (-2, 0, 0), (6, SIZES[1], SIZES[2])))
    with pytest.raises(ValueError, match="mesh of shape"):
        interpolate_mesh(u, torch.zeros(3, 3, 3, dtype=torch.float64), first, SplineBox(4, SIZES))
    with pytest.raises(ValueError, match="order must be 1..6"):
        SplineBox(7, SIZES)
    with pytest.raises(ValueError, match="at least order"):
        SplineBox(5, (12, 4, 10))


# ------------------------------------------------------------------ PME with the kernels
@pytest.mark.parametrize("order", [3, 5])
def test_pme_check_model_with_each_backend(backend, order):
    """Finite-difference forces and stress of PME through the kernels (translation invariance up to the mesh error)."""
    system = random_ionic_cell(n_cells=2, seed=14, net_charge=0.5)
    report = check_model(PME(cutoff=5.0, accuracy=1e-6, order=order, mesh_spacing=0.15), system, atol=1e-4 if order == 3 else 1e-6)
    assert report["forces_vs_finite_differences"] < 1e-8 and report["stress_vs_finite_differences"] < 1e-9


def test_pme_wired_charges_with_each_backend(backend):
    """The chain term dE/dq dq/dr and the stress of a charge model wired into PME, by finite differences."""
    system = random_ionic_cell(n_cells=2, seed=15).replace(fields={})
    pipe = Pipeline(
        [Group([Step(ChargeModel(cutoff=4.0, coordination_weight=0.05, total_charge=-0.2)), Step(PME(5.0, 1e-6, mesh_spacing=0.3))])]
    )
    out = pipe(system, stress=True)
    atoms = [1, 4, 6]
    torch.testing.assert_close(out["forces"][atoms], finite_difference_forces(pipe, system, atoms), rtol=0, atol=1e-6)
    torch.testing.assert_close(out["stress"], finite_difference_stress(pipe, system), rtol=0, atol=1e-7)
