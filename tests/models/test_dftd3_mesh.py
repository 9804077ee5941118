"""D3(BJ) by particle mesh (:class:`~halopipe.models.dftd3_mesh.DFTD3Mesh`) against independent references, float64.

* the closed-form Fourier transform of ``1 / (r^n + a^n)`` against radial quadrature (scipy's QAWF);
* the low-rank C6 decomposition against the packaged reference table;
* energy, forces and stress against s-dftd3 (its Python API) at two-body cutoffs of 50, 100 and 150 Å,
  extrapolated to an infinite cutoff with ``X(rc) = X_inf + A rc^-3`` (least squares over the three), on
  rattled diamond Si, rocksalt MgO and a C/H/O molecular crystal;
* the mesh error model against a converged mesh; finite differences and invariances (``check_model``);
* the real-space ATM term (``s9``) against s-dftd3's.

s-dftd3's ``virial`` is ``dE/d(strain)``, i.e. ``stress * volume``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, molecule
from ase.geometry import cellpar_to_cell

from halopipe.models.dftd3 import DFTD3, _reference
from halopipe.models.dftd3_mesh import DFTD3Mesh, bj_fourier_transform, decompose_c6, default_d3_mesh_spacing, mesh_error_estimate
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System
from halopipe.testing import check_model

pytestmark = pytest.mark.timeout(120)

CUTOFFS = (50.0, 100.0, 150.0)  # Å, s-dftd3's two-body cutoffs for the extrapolation


# ----------------------------------------------------------------------- systems
def _rattled(atoms: Atoms, seed: int = 0, amount: float = 0.05) -> Atoms:
    atoms = atoms.copy()
    atoms.positions += np.random.default_rng(seed).normal(0.0, amount, atoms.positions.shape)
    return atoms


def molecular_crystal() -> Atoms:
    """Methanol and formic acid in a triclinic cell (12 atoms, C/H/O, about 1 g/cm^3)."""
    second = molecule("HCOOH")
    second.positions += [3.2, 2.9, 3.1]
    atoms = molecule("CH3OH") + second
    atoms.cell = cellpar_to_cell([6.1, 6.6, 7.0, 82.0, 95.0, 103.0])
    atoms.pbc = True
    atoms.positions += 1.0
    return _rattled(atoms, seed=2, amount=0.03)


SYSTEMS = {
    "si": lambda: _rattled(bulk("Si", "diamond", a=5.43, cubic=True)),
    "mgo": lambda: _rattled(bulk("MgO", "rocksalt", a=4.21, cubic=True), seed=1),
    "cho": molecular_crystal,
}
FUNCTIONALS = {"si": "pbe", "mgo": "pbe0", "cho": "b3lyp"}


def evaluate(model, atoms: Atoms) -> dict:
    return Pipeline([Group([Step(model)], autograd=True)])(System.from_ase(atoms), stress=True)


def sdftd3(atoms: Atoms, functional: str, cutoff: float, atm: bool = False, atm_cutoff: float = 40 * units.Bohr) -> dict:
    """s-dftd3's energy (eV), forces (eV/Å) and dE/dstrain (eV) at a two-body cutoff (Å); CN cutoff 40 bohr."""
    interface = pytest.importorskip("dftd3.interface")
    model = interface.DispersionModel(atoms.numbers, atoms.positions / units.Bohr, atoms.cell.array / units.Bohr, np.ones(3, dtype=bool))
    model.set_realspace_cutoff(cutoff / units.Bohr, atm_cutoff / units.Bohr, 40.0)
    out = model.get_dispersion(interface.RationalDampingParam(method=functional, atm=atm), grad=True)
    return {
        "energy": float(out["energy"]) * units.Hartree,
        "forces": -np.asarray(out["gradient"]) * units.Hartree / units.Bohr,
        "strain_derivative": np.asarray(out["virial"]) * units.Hartree,
    }


def extrapolated(atoms: Atoms, functional: str) -> dict:
    """s-dftd3 at :data:`CUTOFFS`, each quantity fitted by ``X_inf + A rc^-3``; also the fit's largest residual."""
    runs = [sdftd3(atoms, functional, rc) for rc in CUTOFFS]
    design = np.stack([np.ones(len(CUTOFFS)), np.asarray(CUTOFFS) ** -3.0], axis=1)
    out = {}
    for key in ("energy", "forces", "strain_derivative"):
        values = np.stack([np.reshape(r[key], -1) for r in runs])
        coef, *_ = np.linalg.lstsq(design, values, rcond=None)
        out[key] = coef[0].reshape(np.shape(runs[0][key]))
        out[key + "_residual"] = float(np.abs(design @ coef - values).max())
    out["energy_at_50"] = runs[0]["energy"]
    return out


# ------------------------------------------------------------ Fourier transform
@pytest.mark.parametrize("n", [6, 8])
@pytest.mark.parametrize("a", [2.3, 4.1])
def test_fourier_transform_matches_radial_quadrature(n: int, a: float) -> None:
    """``F(k) = 4 pi / k int r sin(kr) f(r) dr`` (QAWF quadrature for the oscillatory tail), ``F(0) = 4 pi int r^2 f``."""
    integrate = pytest.importorskip("scipy.integrate")
    f = lambda r: 1.0 / (r**n + a**n)  # noqa: E731
    ks = [0.0, 1e-3, 0.07, 0.4, 1.3, 3.7, 9.0]
    reference = []
    for k in ks:
        if k == 0.0:
            value, _ = integrate.quad(lambda r: r * r * f(r), 0.0, np.inf, epsabs=0.0, epsrel=1e-13, limit=400)
            reference.append(4.0 * math.pi * value)
        else:
            # [0, 20 a] adaptively (many oscillations allowed), the smooth decaying tail by QAWF.
            near, _ = integrate.quad(lambda r, k=k: r * f(r) * math.sin(k * r), 0.0, 20.0 * a, epsabs=1e-16, epsrel=1e-13, limit=5000)
            tail, _ = integrate.quad(lambda r: r * f(r), 20.0 * a, np.inf, weight="sin", wvar=k, epsabs=1e-20, epsrel=1e-13)
            reference.append(4.0 * math.pi * (near + tail) / k)
    got = bj_fourier_transform(torch.tensor(ks, dtype=torch.float64), a, n).numpy()
    reference = np.asarray(reference)
    np.testing.assert_allclose(got, reference, rtol=1e-10, atol=1e-12 * reference[0])
    assert got[0] == pytest.approx(4.0 * math.pi**2 * a ** (3 - n) / (n * math.sin(3.0 * math.pi / n)), rel=1e-14)


def test_fourier_transform_gradients_are_finite_at_zero() -> None:
    """``k = 0`` sits on every mesh: the limit is taken without NaN gradients in ``k`` or ``a``; elsewhere they match differences."""
    k = torch.tensor([0.0, 0.3, 1.7], dtype=torch.float64, requires_grad=True)
    a = torch.tensor(3.3, dtype=torch.float64, requires_grad=True)
    (bj_fourier_transform(k, a, 6) + bj_fourier_transform(k, a, 8)).sum().backward()
    assert torch.isfinite(k.grad).all() and torch.isfinite(a.grad) and k.grad[0] == 0.0
    h = 1e-6
    for i in (1, 2):
        up, down = k.detach().clone(), k.detach().clone()
        up[i] += h
        down[i] -= h
        fd = (
            (bj_fourier_transform(up, 3.3, 6) + bj_fourier_transform(up, 3.3, 8))
            - (bj_fourier_transform(down, 3.3, 6) + bj_fourier_transform(down, 3.3, 8))
        )[i] / (2 * h)
        assert float(k.grad[i]) == pytest.approx(float(fd), rel=1e-7)


# ------------------------------------------------------------ decomposition
def _reference_block(species) -> np.ndarray:
    """The reference C6 matrix over (element, reference) pairs, straight from the packaged table."""
    d = _reference()
    index = [(z, a) for z in species for a in range(int(d["n_ref"][z]))]
    return np.array([[d["c6"][z1, z2, a, b] for z2, b in index] for z1, a in index]), index


@pytest.mark.parametrize("species, tolerance", [((14,), 1e-4), ((1, 6, 8), 1e-4), ((1, 6, 8), 1e-7), ((8, 12), 1e-6)])
def test_decomposition_reproduces_the_reference_table(species, tolerance) -> None:
    model = DFTD3Mesh()
    dec = decompose_c6(model.c6ref, model.n_ref, species, tolerance)
    block, index = _reference_block(species)
    scale = units.Hartree * units.Bohr**6  # the model's table is in eV Å^6
    vectors = dec.vectors.numpy()
    rows = np.array([vectors[species.index(z), a] for z, a in index])  # (refs, L)
    approx = (rows * dec.eigenvalues.numpy()) @ rows.T / scale
    error = float((np.abs(approx - block) / block).max())
    assert error <= tolerance and error == pytest.approx(dec.error, rel=1e-6), (error, dec.error)
    assert dec.rank <= dec.full_rank and dec.species == tuple(sorted(species))
    if species == (14,) and tolerance == 1e-4:
        assert dec.rank == 3  # Si: 5 references, rank 3 (the paper's figure)


def test_decomposition_keeps_negative_eigenvalues_and_rejects_unreachable_tolerances() -> None:
    model = DFTD3Mesh()
    dec = decompose_c6(model.c6ref, model.n_ref, (1, 6, 8), 1e-12)  # full rank: the indefinite matrix exactly
    assert dec.rank == dec.full_rank == 10 and bool((dec.eigenvalues < 0).any()) and dec.error < 1e-12
    with pytest.raises(ValueError, match="rank_tolerance"):
        decompose_c6(model.c6ref, model.n_ref, (1, 6, 8), 1e-18)


# ---------------------------------------------------- against s-dftd3 (converged)
@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_against_sdftd3_extrapolated_to_infinite_cutoff(name: str) -> None:
    """Energy to the requested accuracy (1e-6 relative), forces to 3e-6 eV/Å, stress to 2e-5 of its largest component."""
    atoms, functional = SYSTEMS[name](), FUNCTIONALS[name]
    ref = extrapolated(atoms, functional)
    model = DFTD3Mesh(functional, accuracy=1e-6)
    got = evaluate(model, atoms)
    e_rel = abs(float(got["energy"]) - ref["energy"]) / abs(ref["energy"])
    f_err = float(np.abs(got["forces"].numpy() - ref["forces"]).max())
    w = got["stress"].numpy() * atoms.get_volume()
    w_rel = float(np.abs(w - ref["strain_derivative"]).max() / np.abs(ref["strain_derivative"]).max())
    assert ref["energy_residual"] < 1e-7 * abs(ref["energy"]), ref["energy_residual"]  # the extrapolation itself holds
    assert e_rel < 1e-6, (name, e_rel, model.decomposition)
    assert f_err < 3e-6, (name, f_err)
    assert w_rel < 2e-5, (name, w_rel)
    # The cutoff sum at the usual 50.2 Å still misses far more than the mesh's error.
    assert abs(ref["energy_at_50"] - ref["energy"]) > 20 * abs(float(got["energy"]) - ref["energy"])


def test_larger_silicon_against_sdftd3_extrapolated() -> None:
    """64 rattled Si atoms (2x2x2 conventional cells) at the default accuracy, 1e-5."""
    atoms = _rattled(bulk("Si", "diamond", a=5.43, cubic=True).repeat(2), seed=5)
    ref = extrapolated(atoms, "pbe")
    model = DFTD3Mesh("pbe")
    got = evaluate(model, atoms)
    e_rel = abs(float(got["energy"]) - ref["energy"]) / abs(ref["energy"])
    assert e_rel < 1e-5, e_rel
    assert float(np.abs(got["forces"].numpy() - ref["forces"]).max()) < 3e-5
    assert model.decomposition.rank == 3 and model.decomposition.error < 1e-5


# ------------------------------------------------------------------ mesh error
@pytest.mark.parametrize("accuracy", [1e-4, 1e-6])
def test_mesh_error_model(accuracy: float) -> None:
    """The mesh :func:`default_d3_mesh_spacing` picks reaches ``accuracy`` against a converged mesh (same decomposition)."""
    atoms = _rattled(bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat(2), seed=3)
    converged = float(evaluate(DFTD3Mesh("pbe", accuracy=1e-9, rank_tolerance=1e-10), atoms)["energy"])
    model = DFTD3Mesh("pbe", accuracy=accuracy, rank_tolerance=1e-10)
    energy = float(evaluate(model, atoms)["energy"])
    assert abs(energy - converged) / abs(converged) < accuracy
    r0_min = float(model.pair_tables((8, 12), torch.float64, "cpu")[0].min())
    h = default_d3_mesh_spacing(accuracy, r0_min, 6)
    assert mesh_error_estimate(h, r0_min, 6) == pytest.approx(accuracy, rel=1e-6)


# --------------------------------------------------------------- conformance
@pytest.mark.parametrize("name", ["cho", "mgo"])
def test_check_model(name: str) -> None:
    """Finite-difference forces and stress are exact; translation invariance only to the mesh's accuracy.

    A mesh breaks continuous translation symmetry: the energy moves and the
    net force is not zero, by about the mesh error (2e-7 eV/Å on MgO at
    ``accuracy`` 1e-8), so the identities' ``atol`` is 1e-6 here.
    """
    model = DFTD3Mesh(FUNCTIONALS[name], accuracy=1e-8, cn_cutoff=9.3)
    report = check_model(model, System.from_ase(SYSTEMS[name]()), n_fd_atoms=3, force_atol=1e-8, stress_atol=1e-9, atol=1e-6)
    assert report["forces_vs_finite_differences"] < 1e-8 and report["stress_vs_finite_differences"] < 1e-9, report


def test_atm_term_against_sdftd3() -> None:
    """``s9``: the real-space ATM sum with its cutoff; the two-body part cancels in the difference."""
    atoms = SYSTEMS["si"]()
    cut = 9.3
    with_atm = evaluate(DFTD3Mesh("pbe", s9=1.0, atm_cutoff=cut), atoms)
    without = evaluate(DFTD3Mesh("pbe"), atoms)
    ref_with, ref_without = sdftd3(atoms, "pbe", 30.0, atm=True, atm_cutoff=cut), sdftd3(atoms, "pbe", 30.0, atm_cutoff=cut)
    de = float(with_atm["energy"] - without["energy"])
    assert de == pytest.approx(ref_with["energy"] - ref_without["energy"], rel=1e-9, abs=1e-12)
    df = (with_atm["forces"] - without["forces"]).numpy()
    np.testing.assert_allclose(df, ref_with["forces"] - ref_without["forces"], atol=1e-9)


# ------------------------------------------------------------------- errors
def test_rejections() -> None:
    with pytest.raises(ValueError, match="zero.*Becke-Johnson"):
        DFTD3Mesh("pbe", damping="zero")
    with pytest.raises(ValueError, match="accuracy"):
        DFTD3Mesh(accuracy=0.0)
    with pytest.raises(ValueError, match="order"):
        DFTD3Mesh(order=2)
    with pytest.raises(ValueError, match="autograd group"):
        Group([Step(DFTD3Mesh())], autograd=False)
    open_system = System.from_ase(molecule("H2O"))
    with pytest.raises(ValueError, match="periodic"):
        Pipeline([Group([Step(DFTD3Mesh())], autograd=True)])(open_system)


def test_cutoff_sum_is_untouched() -> None:
    """DFTD3 keeps its lattice sums; the mesh model asks for the CN list only, and none with lattice-sum CNs."""
    mesh, plain = DFTD3Mesh(cn_cutoff=11.0), DFTD3(cutoff=30.0, cn_cutoff=11.0)
    assert mesh.cutoff == mesh.halo == (0.0 if mesh.lattice_cn else 11.0) and not mesh.direct_forces and mesh.ghost_forces
    assert mesh.interaction_cutoff == 11.0
    assert DFTD3Mesh(cn_cutoff=8.0, s9=1.0, atm_cutoff=9.5).cutoff == 9.5
    assert plain.direct_forces and plain.cutoff in (0.0, 30.0)


@pytest.mark.parametrize("name, store", [("si", "dense"), ("si", "sparse"), ("si", "overflow"), ("si", "walk"), ("cho", "sparse")])
def test_lattice_coordination_numbers_equal_pair_list(name: str, store: str, monkeypatch) -> None:
    """The Warp lattice-sum CNs (no pair list) equal the torch pair-list CNs, whichever way the chain forces come back.

    ``store``: the walk's pair terms kept in a dense (threads, atoms) table, in per-thread partner slots,
    in slots too few for a thread's partners (so the chain walks again), or not kept (a second walk).
    """
    pytest.importorskip("warp")
    import halopipe.models.dftd3_mesh as module

    monkeypatch.setattr(module, "keeps_chain_terms", lambda threads, atoms: store == "dense")
    monkeypatch.setattr(module, "keeps_sparse_chain_terms", lambda threads, capacity: store != "walk")
    if store == "overflow":
        monkeypatch.setattr(module, "sparse_chain_capacity", lambda n, volume, cutoff: 1)
    model = DFTD3Mesh(FUNCTIONALS[name], accuracy=1e-6)
    if not model.lattice_cn:
        pytest.skip("Warp kernels unavailable")
    atoms = SYSTEMS[name]()
    lattice = evaluate(model, atoms)
    monkeypatch.setattr(DFTD3Mesh, "lattice_cn", property(lambda self: False))  # as without Warp
    listed = evaluate(DFTD3Mesh(FUNCTIONALS[name], accuracy=1e-6), atoms)
    assert float(lattice["energy"]) == pytest.approx(float(listed["energy"]), rel=1e-12)
    assert float((lattice["forces"] - listed["forces"]).abs().max()) < 1e-10
    assert float((lattice["stress"] - listed["stress"]).abs().max()) < 1e-12
    assert float(listed["forces"].abs().max()) > 1e-3


@pytest.mark.parametrize("weights", ["summed", "per_atom"])
def test_mesh_backward_equals_autograd_through_the_mesh(weights: str) -> None:
    """The channels' backward (the forward's potentials reused; for weighted energies, one more convolution)
    gives autograd's gradients through the differentiable spreading kernels and torch.fft, in positions, C6 vectors and cell."""
    from halopipe.kernels.mesh import SplineBox, interpolate_mesh, mesh_coordinates, spread_charges, support_start
    from halopipe.meshfft import LocalMeshTransform
    from halopipe.models.dftd3_mesh import _Channels, _MeshDispersion
    from halopipe.models.particle_mesh import CotangentCheck, Stencil

    atoms = SYSTEMS["cho"]()
    model = DFTD3Mesh("b3lyp", accuracy=1e-4)
    species = tuple(sorted(set(atoms.numbers.tolist())))
    dec = model.decompose(species)
    lam = dec.eigenvalues
    sidx = torch.as_tensor(np.searchsorted(species, atoms.numbers))
    g = torch.Generator().manual_seed(4)
    c0 = torch.rand(len(atoms), dec.rank, generator=g, dtype=torch.float64)
    w = torch.ones(len(atoms), dtype=torch.float64)
    if weights == "per_atom":
        w = 0.5 + torch.rand(len(atoms), generator=g, dtype=torch.float64)
    positions0, cell0 = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    sizes = model.mesh(cell0, species)
    transform = LocalMeshTransform(sizes)

    def reference(positions, cell, c):  # autograd through every step, one channel at a time
        u = mesh_coordinates(positions, cell, sizes)
        first, box = support_start(u, model.order), SplineBox(model.order, tuple(sizes))
        kernel = model._kernel(cell, transform, species)
        spectra = []
        for slot in range(dec.rank):
            boxes = [spread_charges(u[sidx == s], c[sidx == s, slot], first[sidx == s], box) for s in range(len(species))]
            spectra.append(torch.fft.rfftn(torch.stack(boxes), dim=(-3, -2, -1)))
        spectra = torch.stack(spectra)
        filtered = torch.einsum("st...,lt...->ls...", kernel.to(spectra.dtype), spectra)
        potentials = torch.fft.irfftn(filtered, s=sizes, dim=(-3, -2, -1), norm="forward")
        phi = torch.zeros(len(atoms), dec.rank, dtype=torch.float64)
        for slot in range(dec.rank):
            for s in range(len(species)):
                phi = phi.index_put(
                    (torch.nonzero(sidx == s).squeeze(1), torch.tensor(slot)),
                    interpolate_mesh(u[sidx == s], potentials[slot, s], first[sidx == s], box),
                )
        return 0.5 * (lam * c * phi).sum(dim=1)

    def channels(positions, cell, c):
        stencil = Stencil(cell, positions, sizes, model.order, whole_mesh=True)
        plan = _Channels(stencil, sidx, len(species), lam, transform, None)
        energies, not_summed = _MeshDispersion.apply(stencil.u, c, model._kernel(cell, transform, species), plan)
        return CotangentCheck.apply(energies, not_summed)  # one process: the global sum is the identity

    def weighted(fn):
        leaves = [x.clone().requires_grad_(True) for x in (positions0, cell0, c0)]
        total = (w * fn(*leaves)).sum()
        return (total, *torch.autograd.grad(total, leaves))

    got, ref = weighted(channels), weighted(reference)
    assert float(got[0].detach()) == pytest.approx(float(ref[0].detach()), rel=1e-12)
    for name, a, b in zip(("dL/dr", "dL/dcell", "dL/dc"), got[1:], ref[1:]):
        assert float((a - b).abs().max()) < 1e-11 * float(b.abs().max()), name
