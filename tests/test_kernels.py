"""Pair kernels: the Warp kernel and its eager-torch twin against independent references."""

import math

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLJ

from halopipe import ChargeModel, DomainConfig, DSFCoulomb, Ewald, Group, LennardJones, Pipeline, Step, System
from halopipe.kernels import backend as kernel_backend_module
from halopipe.kernels import charges as charge_kernels
from halopipe.kernels import coulomb as coulomb_kernels
from halopipe.kernels import ewald as ewald_kernels
from halopipe.kernels import lennard_jones as lj_kernels
from halopipe.kernels import pairs as pair_kernels
from halopipe.models.coulomb import COULOMB_CONSTANT
from halopipe.neighbors import GroupedPairs, owned_half_pairs, owned_pairs
from halopipe.testing import check_model


def _argon(repeat=2, seed=3):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((repeat,) * 3)
    atoms.rattle(0.15, seed=seed)
    return atoms


@pytest.mark.parametrize("autograd", [True, False])
def test_lennard_jones_matches_ase_with_each_backend(backend, autograd):
    atoms = _argon()
    atoms.calc = AseLJ(sigma=3.4, epsilon=0.0103, rc=7.0)
    out = Pipeline([Group([LennardJones(0.0103, 3.4, 7.0)], autograd=autograd)], config=DomainConfig(skin=0.8))(
        System.from_ase(atoms), stress=True
    )
    assert float(out["energy"]) == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), atol=1e-12)
    np.testing.assert_allclose(out["stress"].numpy(), atoms.get_stress(voigt=False), atol=1e-13)


def test_check_model_with_each_backend(backend, nacl):
    check_model(LennardJones({11: 0.0115, 17: 0.0043}, {11: 2.6, 17: 3.6}, 6.0), nacl)


def test_weighted_backward_matches_autograd_of_pair_formula(backend):
    """d(sum_i w_i e_i)/dr for non-uniform w (the kernel's recompute path) against plain torch autograd."""
    atoms = _argon(repeat=1)
    rows = torch.tensor(atoms.positions, dtype=torch.float64)
    n = rows.shape[0]
    pairs = owned_half_pairs(rows, n, 4.5)
    half = pair_kernels.HalfList.from_pairs(pairs, n, True)
    model = LennardJones(0.0103, 3.4, 4.0)
    tables = model._tables(torch.tensor([18]), torch.float64)
    weights = torch.linspace(0.5, 2.0, n, dtype=torch.float64)

    x = rows.clone().requires_grad_(True)
    (grad_kernel,) = torch.autograd.grad((lj_kernels.lj_energies_autograd(x, half, tables, n) * weights).sum(), x)

    y = rows.clone().requires_grad_(True)
    full = owned_pairs(rows, n, 4.0)
    r = (y[full[1]] - y[full[0]]).norm(dim=1)
    s6 = (3.4 / r) ** 6
    c6 = (3.4 / 4.0) ** 6
    u = 4 * 0.0103 * (s6 * s6 - s6 - c6 * c6 + c6)
    energies = torch.zeros(n, dtype=torch.float64).index_add(0, full[0], 0.5 * u)
    (grad_ref,) = torch.autograd.grad((energies * weights).sum(), y)
    torch.testing.assert_close(grad_kernel, grad_ref, atol=1e-13, rtol=0)


def test_launches_on_tensors_of_one_layout_give_each_its_own_forces_and_pin_none(backend):
    """Warp's array descriptors are kept by memory layout (``kernels.pairs``): several position arrays of one shape, all
    alive at once (each at its own address), each get their own forces, against ASE; the kept descriptors hold no
    tensor (Warp's own descriptor references its tensor, which would keep every launched array alive)."""
    atoms = _argon()
    atoms.pbc = False
    rows0 = torch.tensor(atoms.positions, dtype=torch.float64)
    n = rows0.shape[0]
    half = pair_kernels.HalfList.from_pairs(owned_half_pairs(rows0, n, 7.0), n, True)
    tables = LennardJones(0.0103, 3.4, 6.0)._tables(torch.tensor([18]), torch.float64)
    rng = np.random.default_rng(5)
    arrays = []
    for k in range(4):
        moved = atoms.copy()
        moved.positions += rng.normal(scale=0.02, size=moved.positions.shape)  # within the 1 Å the list has to spare
        moved.calc = AseLJ(sigma=3.4, epsilon=0.0103, rc=6.0)
        arrays.append(torch.tensor(moved.positions, dtype=torch.float64))
        _, forces, _ = lj_kernels.lj_direct(arrays[-1], half, tables, n, energy=False, virial=False)
        np.testing.assert_allclose(forces.numpy(), moved.get_forces(), atol=1e-12, err_msg=f"array {k}")
    kept = list(pair_kernels._DESCRIPTORS.values())
    assert backend == "torch" or kept
    assert all(getattr(d, "_ref", None) is None for d in kept)


def test_half_list_holds_each_owned_pair_once():
    """10 of 32 rows owned: every pair within the cutoff with an owned end, once, against all distances by cdist."""
    rows = torch.tensor(_argon(repeat=2).positions, dtype=torch.float64)
    n_owned = 10
    half = owned_half_pairs(rows, n_owned, 4.0)
    assert bool((half[0] < n_owned).all())
    as_set = lambda p: {tuple(sorted(x)) for x in p.T.tolist()}  # noqa: E731
    i, j = torch.nonzero(torch.cdist(rows, rows) <= 4.0, as_tuple=True)
    want = {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}
    assert len(want) > n_owned and as_set(half) == want
    assert half.shape[1] == len(want)


def test_owned_rows_beyond_the_rows_are_refused():
    rows = torch.tensor(_argon(repeat=1).positions, dtype=torch.float64)
    with pytest.raises(ValueError, match="n_owned=10 .* 4 rows"):
        owned_half_pairs(rows, 10, 4.0)


def test_empty_view_gives_zero_energy(backend):
    rows = torch.zeros(0, 3, dtype=torch.float64, requires_grad=True)
    half = pair_kernels.HalfList.from_pairs(torch.zeros(2, 0, dtype=torch.int64), 0, True)
    tables = LennardJones()._tables(torch.tensor([18]), torch.float64)
    e = lj_kernels.lj_energies_autograd(rows, half, tables, 0)
    assert e.shape == (0,)
    (g,) = torch.autograd.grad(e.sum() + 0.0 * rows.sum(), rows)
    assert g.shape == (0, 3)


def test_check_model_of_wired_ewald_with_each_backend(backend, nacl):
    """Forces, stress and the wired chain term dE/dq dq/dr through the real-space kernel, by finite differences."""
    from halopipe.testing import finite_difference_forces

    pipe = Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(Ewald(cutoff=5.0, accuracy=1e-8))], autograd=True)])
    out = pipe(nacl)
    fd = finite_difference_forces(pipe, nacl, [0, 5, 11])
    torch.testing.assert_close(out["forces"][[0, 5, 11]], fd, rtol=0, atol=1e-6)
    check_model(Ewald(cutoff=5.0, accuracy=1e-8), nacl)


def test_real_space_weighted_backward_matches_autograd(backend):
    """Gradients of sum_i w_i e_i to positions and charges (kernel recompute path) against plain torch autograd."""
    atoms = _argon(repeat=1)
    rows = torch.tensor(atoms.positions, dtype=torch.float64)
    n = rows.shape[0]
    charges = torch.linspace(-1.0, 1.2, n, dtype=torch.float64)
    weights = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    alpha, cutoff = 0.6, 4.0
    half = pair_kernels.HalfList.from_pairs(owned_half_pairs(rows, n, cutoff + 0.5), n, True)

    x, q = rows.clone().requires_grad_(True), charges.clone().requires_grad_(True)
    e = ewald_kernels.real_space_energies_autograd(x, q, half, cutoff, alpha, COULOMB_CONSTANT, n)
    got = torch.autograd.grad((e * weights).sum(), [x, q])

    y, p = rows.clone().requires_grad_(True), charges.clone().requires_grad_(True)
    full = owned_pairs(rows, n, cutoff)
    r = (y[full[1]] - y[full[0]]).norm(dim=1)
    u = COULOMB_CONSTANT * p[full[0]] * p[full[1]] * torch.erfc(alpha * r) / r
    ref_e = torch.zeros(n, dtype=torch.float64).index_add(0, full[0], 0.5 * u)
    want = torch.autograd.grad((ref_e * weights).sum(), [y, p])
    torch.testing.assert_close(e.detach(), ref_e.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-12, rtol=0)


def test_dftd3_with_each_backend_passes_check_model(backend, nacl):
    """The compiled D3(BJ) path (CN and two-body kernels, analytic backward) by finite differences, in both groups."""
    from halopipe import DFTD3

    check_model(DFTD3("pbe", cutoff=9.0, cn_cutoff=6.0), nacl)


def test_half_list_on_a_wide_halo_matches_the_full_list():
    """Rows far beyond 8x the owned atoms take the owned-centred cell list; still each pair once."""
    rows = torch.tensor(_argon(repeat=3).positions, dtype=torch.float64)
    n_owned = 12
    half = owned_half_pairs(rows, n_owned, 6.0)
    as_set = lambda p: {tuple(sorted(x)) for x in p.T.tolist()}  # noqa: E731
    i, j = torch.nonzero(torch.cdist(rows, rows) <= 6.0, as_tuple=True)  # all distances: independent of the search
    assert as_set(half) == {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}
    assert half.shape[1] == len(as_set(half)) and bool((half[0] < n_owned).all())


def _dsf_pair(r, alpha, rc):
    """Fennell-Gezelter DSF pair function, written out in torch (differentiable)."""
    shift = math.erfc(alpha * rc) / rc
    slope = math.erfc(alpha * rc) / rc**2 + 2 * alpha / math.sqrt(math.pi) * math.exp(-((alpha * rc) ** 2)) / rc
    return torch.erfc(alpha * r) / r - shift + slope * (r - rc)


def test_dsf_weighted_backward_matches_autograd(backend):
    """DSF energies and the gradients of sum_i w_i e_i to positions and charges (recompute path) against torch autograd."""
    atoms = _argon(repeat=1)
    rows = torch.tensor(atoms.positions, dtype=torch.float64)
    n = rows.shape[0]
    charges = torch.linspace(-1.0, 1.2, n, dtype=torch.float64)
    weights = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    alpha, cutoff = 0.3, 4.0
    model = DSFCoulomb(cutoff, alpha)
    half = pair_kernels.HalfList.from_pairs(owned_half_pairs(rows, n, cutoff + 0.5), n, True)

    x, q = rows.clone().requires_grad_(True), charges.clone().requires_grad_(True)
    e = coulomb_kernels.coulomb_energies_autograd(x, q, half, model._pair, n)
    got = torch.autograd.grad((e * weights).sum(), [x, q])

    y, p = rows.clone().requires_grad_(True), charges.clone().requires_grad_(True)
    full = owned_pairs(rows, n, cutoff)
    r = (y[full[1]] - y[full[0]]).norm(dim=1)
    u = COULOMB_CONSTANT * p[full[0]] * p[full[1]] * _dsf_pair(r, alpha, cutoff)
    ref_e = torch.zeros(n, dtype=torch.float64).index_add(0, full[0], 0.5 * u)
    want = torch.autograd.grad((ref_e * weights).sum(), [y, p])
    torch.testing.assert_close(e.detach(), ref_e.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-12, rtol=0)


def test_coordination_weighted_backward_matches_autograd(backend):
    """Cosine coordination numbers and d(sum_i w_i CN_i)/dr against torch autograd of the formula on the full list."""
    atoms = _argon(repeat=1)
    rows = torch.tensor(atoms.positions, dtype=torch.float64)
    n = rows.shape[0]
    weights = torch.linspace(-0.7, 1.9, n, dtype=torch.float64)
    cutoff = 4.2
    half = pair_kernels.HalfList.from_pairs(owned_half_pairs(rows, n, cutoff + 0.5), n, True)

    x = rows.clone().requires_grad_(True)
    cn = charge_kernels.coordination_autograd(x, half, cutoff, n)
    (got,) = torch.autograd.grad((cn * weights).sum(), x)

    y = rows.clone().requires_grad_(True)
    full = owned_pairs(rows, n, cutoff)
    r = (y[full[1]] - y[full[0]]).norm(dim=1)
    ref = torch.zeros(n, dtype=torch.float64).index_add(0, full[0], 0.5 * (1.0 + torch.cos(math.pi * r / cutoff)))
    (want,) = torch.autograd.grad((ref * weights).sum(), y)
    assert int((ref > 0).sum()) == n  # every atom has neighbours within the cutoff: the check is not vacuous
    torch.testing.assert_close(cn.detach(), ref.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def _with_backend(monkeypatch, name: str, fn):
    """``fn()`` with the kernel technology ``name`` (caches cleared before and after)."""
    monkeypatch.setenv("HALOPIPE_KERNELS", name)
    kernel_backend_module.warp_module.cache_clear()
    pair_kernels.warp_kernel.cache_clear()
    try:
        return fn()
    finally:
        kernel_backend_module.warp_module.cache_clear()
        pair_kernels.warp_kernel.cache_clear()


@pytest.mark.parametrize("grouped", [False, True])
def test_charge_kernels_warp_equal_their_torch_twins(monkeypatch, nacl, grouped):
    """The Warp DSF and coordination kernels against their eager twins on the same half list, weights and charges.

    ``grouped``: the list grouped by owned row, as a domain's lists come; else as pairs, which the kernels group first.
    """
    if _with_backend(monkeypatch, "warp", lambda: pair_kernels.warp_kernel("damped_coulomb_grouped", "_warp_electrostatics")) is None:
        pytest.skip("NVIDIA Warp is not available here")
    rows = nacl.positions
    n = rows.shape[0]
    pairs = owned_half_pairs(rows, n, 6.0)
    if grouped:
        by_row = GroupedPairs.from_pairs(pairs, n)
        half = pair_kernels.HalfList(None, by_row.partners, by_row.start)
    else:
        half = pair_kernels.HalfList.from_pairs(pairs, n, True)
    weights = torch.linspace(0.3, 1.7, n, dtype=torch.float64)
    charges = nacl.fields["charges"] * torch.linspace(0.8, 1.1, n, dtype=torch.float64)
    pair = DSFCoulomb(5.5, 0.25)._pair

    def run():
        cn = charge_kernels.coordination_numbers(rows, half, 5.5)
        cn_grad = charge_kernels.coordination_gradient(rows, half, 5.5, weights)
        return (*coulomb_kernels.coulomb_terms(rows, charges, half, pair, weights), cn, cn_grad)

    warp, twin = _with_backend(monkeypatch, "warp", run), _with_backend(monkeypatch, "torch", run)
    for w, t in zip(warp, twin):
        assert bool(t.abs().max() > 0)
        torch.testing.assert_close(w, t, atol=1e-12, rtol=1e-12)
    # fixed charges: the kernel without dE/dq gives the same energies and forces, and no charge gradient
    fixed = _with_backend(monkeypatch, "warp", lambda: coulomb_kernels.coulomb_terms(rows, charges, half, pair, weights, charge_grad=False))
    assert fixed[2] is None
    torch.testing.assert_close(fixed[0], twin[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(fixed[1], twin[1], atol=1e-12, rtol=1e-12)


def test_check_model_of_dsf_with_each_backend(backend, nacl):
    """DSF through the kernel: direct and autograd forces and stress against finite differences, periodic and not."""
    from .conftest import cluster

    check_model(DSFCoulomb(7.0, 0.2), nacl)
    check_model(DSFCoulomb(6.0, 0.0), cluster(24))


def test_wired_charges_into_dsf_with_each_backend(backend, nacl):
    """ChargeModel -> DSFCoulomb through both kernels: forces and stress (with the chain term) by finite differences."""
    from halopipe.testing import finite_difference_forces, finite_difference_stress

    pipe = Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(DSFCoulomb(7.0, 0.2))], autograd=True)])
    out = pipe(nacl, stress=True)
    fd = finite_difference_forces(pipe, nacl, [0, 5, 11])
    torch.testing.assert_close(out["forces"][[0, 5, 11]], fd, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["stress"], finite_difference_stress(pipe, nacl), rtol=0, atol=1e-7)
    check_model(ChargeModel(cutoff=3.5, hardness={11: 2.0, 17: 1.0}), nacl)


def test_erfc_sharing_the_force_exponential_matches_libm(monkeypatch):
    """The damped-Coulomb kernel's erfc (Cody's rationals times the force's exp(-x^2)) against torch's (libm's) erfc."""
    if _with_backend(monkeypatch, "warp", lambda: pair_kernels.warp_kernel("damped_coulomb_grouped", "_warp_electrostatics")) is None:
        pytest.skip("NVIDIA Warp is not available here")
    import warp as wp

    from halopipe.kernels import _warp_electrostatics as source

    @wp.kernel
    def erfc_of(x: wp.array(dtype=wp.float64), out: wp.array(dtype=wp.float64)):
        i = wp.tid()
        out[i] = source.erfc_given_gauss(x[i], wp.exp(-x[i] * x[i]))

    # every branch and both branch points; erfc falls to 1.5e-16 at x = 5.9
    x = torch.cat([torch.linspace(0.0, 5.9, 100_001, dtype=torch.float64), torch.tensor([0.46875, 4.0], dtype=torch.float64)])
    out = torch.zeros_like(x)
    wp.launch(erfc_of, dim=x.numel(), inputs=[wp.from_torch(x)], outputs=[wp.from_torch(out)], device="cpu")
    torch.testing.assert_close(out, torch.special.erfc(x), rtol=5e-15, atol=0.0)


def test_a_tensor_of_the_wrong_dtype_is_refused_before_the_launch(monkeypatch):
    """Descriptors carry no dtype for Warp to check: the launcher checks each tensor against the kernel's argument types.

    A float32 position array passed where the kernel reads float64 rows is refused before the launch, with an error
    naming the kernel, the argument and both dtypes, and the outputs are left untouched.
    """
    kernel = _with_backend(monkeypatch, "warp", lambda: pair_kernels.warp_kernel("nearest_image", "_warp_geometry"))
    if kernel is None:
        pytest.skip("NVIDIA Warp is not available here")
    n = 4
    bounds = torch.tensor([0.0, 1.0], dtype=torch.float64)
    wp = kernel_backend_module.warp_module()
    images, dist = torch.full((n, 3), 7, dtype=torch.int32), torch.full((n,), 7.0, dtype=torch.float64)
    geometry = [bounds, bounds, bounds, wp.vec3i(1, 1, 1), wp.vec3d(10.0, 10.0, 10.0)]
    brick = torch.zeros(n, 3, dtype=torch.int32)
    cpu = torch.device("cpu")
    with pytest.raises(TypeError, match=r"'nearest_image'.*'wrapped' takes torch.float64 tensors, got torch.float32"):
        pair_kernels.launch(kernel, n, cpu, [torch.full((n, 3), 0.5, dtype=torch.float32), brick, *geometry], [images, dist])
    assert bool((dist == 7.0).all())
    pair_kernels.launch(kernel, n, cpu, [torch.full((n, 3), 0.5, dtype=torch.float64), brick, *geometry], [images, dist])
    assert bool((images == 0).all()) and bool((dist == 0.0).all())  # the same call with float64 rows: inside the brick
