"""Ewald summation: Madelung constants, torch-pme, conformance, wiring, domain splits."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from ase.build import bulk

from halopipe.models.base import LocalView
from halopipe.models.charges import ChargeModel
from halopipe.models.coulomb import COULOMB_CONSTANT
from halopipe.models.ewald import Ewald, ewald_parameters
from halopipe.models.pme import PME
from halopipe.neighbors import neighbor_list
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System
from halopipe.testing import check_model, finite_difference_forces, finite_difference_stress

from ..conftest import random_ionic_cell

pytestmark = pytest.mark.timeout(180)


# ----------------------------------------------------------------- systems


def ionic_crystal(atoms, cation: int) -> System:
    atoms.set_initial_charges(np.where(atoms.numbers == cation, 1.0, -1.0))
    return System.from_ase(atoms)


def energy(model, system: System, stress: bool = False) -> dict:
    return Pipeline([Group([Step(model)], autograd=True)])(system, stress=stress)


# --------------------------------------------------------------- Madelung
WURTZITE_A = 3.2
# (label, atoms, cation Z, nearest-neighbour distance, Madelung constant per ion pair, relative tolerance)
MADELUNG = [
    # Madelung constants referred to the nearest-neighbour distance d: E per ion pair = -M k_e / d.
    ("NaCl", bulk("NaCl", "rocksalt", a=5.64), 11, 5.64 / 2, 1.747564594633, 1e-8),
    ("CsCl", bulk("CsCl", "cesiumchloride", a=4.12), 55, 4.12 * math.sqrt(3) / 2, 1.762674773070, 1e-8),
    ("zincblende", bulk("ZnS", "zincblende", a=5.41), 30, 5.41 * math.sqrt(3) / 4, 1.638055053388, 1e-8),
    # Ideal wurtzite (c/a = sqrt(8/3), u = 3/8, all four neighbours at d = a sqrt(3/8)). The tabulated
    # reference 1.641321 (nearest-neighbour convention, as in CRC-style Madelung tables) carries only
    # 7 significant digits (truncated), so it is checked to one unit of its last digit.
    (
        "wurtzite",
        bulk("ZnO", "wurtzite", a=WURTZITE_A, c=WURTZITE_A * math.sqrt(8 / 3), u=3 / 8),
        30,
        WURTZITE_A * math.sqrt(3 / 8),
        1.641321,
        1e-6 / 1.641321,
    ),
]


@pytest.mark.parametrize("label, atoms, cation, d, reference, rtol", MADELUNG, ids=[m[0] for m in MADELUNG])
def test_madelung_constants(label, atoms, cation, d, reference, rtol):
    system = ionic_crystal(atoms.copy(), cation)
    e = float(energy(Ewald(cutoff=8.0, accuracy=1e-13), system)["energy"])
    madelung = -e * d / (COULOMB_CONSTANT * system.n_atoms / 2)
    assert abs(madelung - reference) <= rtol * reference, f"{label}: M = {madelung:.12f}, reference {reference}"


def test_madelung_supercell_and_shifted_origin():
    """A rotated-origin supercell must give the same Madelung constant (per-atom energies equal by symmetry)."""
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((2, 1, 1))
    atoms.translate([0.3, -0.7, 1.1])
    system = ionic_crystal(atoms, 11)
    out = energy(Ewald(cutoff=7.0, accuracy=1e-13), system)
    madelung = -float(out["energy"]) * (5.64 / 2) / (COULOMB_CONSTANT * system.n_atoms / 2)
    assert abs(madelung - 1.747564594633) <= 1e-8 * 1.747564594633


# ------------------------------------------------------------- torch-pme
def torchpme_reference(system: System, alpha: float, kmax: float, cutoff: float):
    """Per-atom energies and forces from torch-pme's EwaldCalculator, in halopipe's Coulomb units."""
    import torchpme
    from torchpme.prefactors import eV_A

    pos = system.positions.clone().requires_grad_(True)
    cell = system.cell
    i, j, shifts = neighbor_list(system.positions, cell, system.pbc, cutoff, full=True)
    dist = (pos[j] + shifts.to(pos.dtype) @ cell - pos[i]).norm(dim=1)
    # torch-pme smears charges with exp(-r^2 / (2 sigma^2)): alpha = 1 / (sqrt(2) sigma).
    potential = torchpme.CoulombPotential(smearing=1.0 / (math.sqrt(2.0) * alpha), prefactor=eV_A)
    # torch-pme keeps integer k-indices |n_i| <= ceil(k_c |a_i| / 2 pi) / 2 for k_c = 2 pi / lr_wavelength
    # (fftfreq over that many points), so k_c = 2 kmax makes its k-box contain our sphere |k| <= kmax.
    calc = torchpme.EwaldCalculator(potential, lr_wavelength=math.pi / kmax, full_neighbor_list=True).to(torch.float64)
    q = system.fields["charges"][:, None]
    phi = calc(charges=q, cell=cell, positions=pos, neighbor_indices=torch.stack([i, j], 1), neighbor_distances=dist)
    # torch-pme's eV_A (14.39964548) and ase's Hartree*Bohr (14.39964535) differ by 9e-9 relative.
    per_atom = (q * phi)[:, 0] * (COULOMB_CONSTANT / eV_A)
    (grad,) = torch.autograd.grad(per_atom.sum(), pos)
    return per_atom.detach(), -grad


@pytest.mark.parametrize("seed", [0, 1])
def test_against_torchpme_ewald(seed):
    system = random_ionic_cell(n_cells=3, seed=seed, net_charge=0.7)
    model = Ewald(cutoff=6.0, accuracy=1e-11)
    ref_e, ref_f = torchpme_reference(system, model.alpha, model.kmax, model.cutoff)
    out = energy(model, system)
    assert float(out["energy"]) == pytest.approx(float(ref_e.sum()), rel=1e-9, abs=1e-8)
    # Same energy partition (half pairs, q_i-weighted long-range potential): per-atom energies agree too.
    per_atom = split_evaluate(model, system, torch.zeros(system.n_atoms, dtype=torch.int64), n_ranks=1)[2]
    torch.testing.assert_close(per_atom, ref_e, rtol=0, atol=1e-8)
    scale = float(ref_f.abs().max())
    torch.testing.assert_close(out["forces"], ref_f, rtol=0, atol=1e-8 * scale)


# --------------------------------------------------------------- conformance
def test_check_model_charged_triclinic():
    system = random_ionic_cell(n_cells=2, seed=3, net_charge=0.5)
    report = check_model(Ewald(cutoff=5.0, accuracy=1e-8), system)
    assert report["stress_vs_finite_differences"] < 1e-7


def test_background_makes_charged_cell_energy_independent_of_alpha():
    """With the neutralising background the total energy of a charged cell is a physical (alpha-free) quantity."""
    system = random_ionic_cell(n_cells=2, seed=4, net_charge=1.5)
    # alpha * cutoff >= 5.6 keeps the real-space truncation below 1e-13 for every alpha tried.
    e = [float(energy(Ewald(cutoff=8.0, accuracy=1e-12, alpha=a), system)["energy"]) for a in (0.7, 0.8, 0.95)]
    assert max(e) - min(e) < 1e-8 * max(1.0, abs(e[0]))


def test_accuracy_controls_force_error():
    """Looser accuracy settings stay within a small multiple of the requested relative force error."""
    system = random_ionic_cell(n_cells=3, seed=5)
    ref = energy(Ewald(cutoff=6.0, accuracy=1e-13), system)["forces"]
    scale = float(ref.norm(dim=1).max())
    for acc in (1e-4, 1e-6):
        f = energy(Ewald(cutoff=6.0, accuracy=acc), system)["forces"]
        assert float((f - ref).norm(dim=1).max()) < 3 * acc * scale


@pytest.mark.parametrize("cutoff, accuracy", [(8.0, 1e-6), (6.0, 1e-12), (10.0, 1e-4)])
def test_parameters_bound_both_truncation_errors(cutoff, accuracy):
    """The promise, checked with the standard library's erfc: both neglected tails are below the accuracy, without waste."""
    alpha, kmax = ewald_parameters(cutoff, accuracy)
    assert math.erfc(alpha * cutoff) <= accuracy  # real-space term erfc(alpha r) at the cutoff
    assert math.exp(-((kmax / (2 * alpha)) ** 2)) <= accuracy * (1 + 1e-12)  # reciprocal Gaussian at k_max
    assert math.erfc(alpha * 0.9 * cutoff) > accuracy  # not needlessly conservative: 10 % less cutoff would miss it
    assert math.exp(-((0.9 * kmax / (2 * alpha)) ** 2)) > accuracy
    # Overrides are taken as given; k_max still bounds the reciprocal tail for an overridden alpha.
    alpha_given, kmax_follows = ewald_parameters(cutoff, accuracy, alpha=0.5)
    assert alpha_given == 0.5 and math.exp(-((kmax_follows / 1.0) ** 2)) <= accuracy * (1 + 1e-12)
    assert ewald_parameters(cutoff, accuracy, kmax=3.0) == (alpha, 3.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cutoff": 0.0},
        {"cutoff": 6.0, "accuracy": 0.0},
        {"cutoff": 6.0, "accuracy": 2.0},
        {"cutoff": 6.0, "alpha": -1.0},
        {"cutoff": 6.0, "kmax": 0.0},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        Ewald(**kwargs)


def test_non_periodic_cell_is_rejected():
    system = random_ionic_cell(n_cells=2, seed=6)
    slab = system.replace(pbc=torch.tensor([True, True, False]))
    with pytest.raises(ValueError, match="periodic along all three axes"):
        energy(Ewald(cutoff=5.0), slab)


# -------------------------------------------------------------- wired charges
def test_wired_charges_forces_and_stress():
    """Charges produced by a charge model flow with their graph: forces and stress include dE/dq dq/dr."""
    system = random_ionic_cell(n_cells=2, seed=7)
    system = system.replace(fields={})
    charge_model = ChargeModel(cutoff=4.0, coordination_weight=0.05, total_charge=0.3)
    pipe = Pipeline([Group([Step(charge_model), Step(Ewald(cutoff=5.0, accuracy=1e-8))])])
    out = pipe(system, stress=True)
    atoms = [0, 3, 5]
    fd = finite_difference_forces(pipe, system, atoms)
    torch.testing.assert_close(out["forces"][atoms], fd, rtol=0, atol=1e-6)
    torch.testing.assert_close(out["stress"], finite_difference_stress(pipe, system), rtol=0, atol=1e-7)


# ------------------------------------------------------- domain decomposition
def split_evaluate(model, system: System, owner: torch.Tensor, n_ranks: int):
    """Evaluate ``model`` as ``n_ranks`` emulated ranks (threads) that own ``owner == r`` atoms.

    Each rank gets a LocalView of its owned atoms, with one explicit ghost row
    per pair image, and a ``global_sum`` that is a real collective across the
    threads (built into one autograd graph, so the backward is exact). Returns
    total energy, forces and per-atom energies (by global index).
    """
    positions = system.positions.clone().requires_grad_(True)
    cell, q = system.cell, system.fields["charges"]
    i, j, shifts = neighbor_list(system.positions, cell, system.pbc, model.cutoff, full=True)
    barrier = threading.Barrier(n_ranks, timeout=60)
    slots: list = [None] * n_ranks
    results: list = [None] * n_ranks
    errors: list = []

    def make_view(rank: int) -> tuple[LocalView, torch.Tensor]:
        owned = (owner == rank).nonzero()[:, 0]
        local = torch.full((system.n_atoms,), -1, dtype=torch.int64)
        local[owned] = torch.arange(len(owned))
        keep = local[i] >= 0
        pi, pj, ps = local[i[keep]], j[keep], shifts[keep].to(positions.dtype)
        ghosts = positions[pj] + ps @ cell
        rows = torch.cat([positions[owned], ghosts])
        pairs = torch.stack([pi, len(owned) + torch.arange(len(pj))])
        vec = rows[pairs[1]] - rows[pairs[0]]

        def global_sum(x: torch.Tensor) -> torch.Tensor:
            slots[rank] = x
            barrier.wait()
            total = sum(slots[1:], slots[0])
            barrier.wait()
            return total

        view = LocalView(
            positions=rows,
            numbers=torch.cat([system.numbers[owned], system.numbers[pj]]),
            n_owned=len(owned),
            cell=cell,
            pbc=system.pbc,
            pairs=pairs,
            vectors=vec,
            distances=vec.norm(dim=1),
            fields={"charges": torch.cat([q[owned], q[pj]])},
            refresh=lambda x: x,
            global_sum=global_sum,
            n_total=system.n_atoms,
            ids=torch.cat([owned, pj]),
            cutoff=model.cutoff,
        )
        return view, owned

    def run(rank: int) -> None:
        try:
            view, owned = make_view(rank)
            results[rank] = (owned, model(view).energies)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    per_atom = torch.zeros(system.n_atoms, dtype=positions.dtype)
    for owned, e in results:
        per_atom = per_atom.index_add(0, owned, e)
    total = per_atom.sum()
    (grad,) = torch.autograd.grad(total, positions)
    return float(total.detach()), -grad, per_atom.detach()


@pytest.mark.parametrize(
    "model_factory", [lambda: Ewald(cutoff=5.0, accuracy=1e-8), lambda: PME(cutoff=5.0, accuracy=1e-5, order=5)], ids=["Ewald", "PME"]
)
@pytest.mark.parametrize("split", ["halves", "one_rank_empty", "three_ranks"])
def test_domain_split_reproduces_single_process(model_factory, split):
    """Owned-atom structure factors / meshes summed by global_sum give the single-process energy and forces."""
    model = model_factory()
    system = random_ionic_cell(n_cells=2, seed=8, net_charge=0.3)
    n = system.n_atoms
    if split == "halves":
        owner, ranks = (system.positions[:, 0] > system.positions[:, 0].median()).long(), 2
    elif split == "one_rank_empty":
        owner, ranks = torch.zeros(n, dtype=torch.int64), 2
    else:
        owner, ranks = torch.arange(n) % 3, 3
    ref = energy(model, system)
    e, f, _ = split_evaluate(model, system, owner, ranks)
    assert e == pytest.approx(float(ref["energy"]), rel=1e-12, abs=1e-10)
    torch.testing.assert_close(f, ref["forces"], rtol=0, atol=1e-10 * float(ref["forces"].abs().max()))


def test_kvector_chunks_do_not_change_the_result(monkeypatch):
    """Processing the k-vectors in many small chunks (the large-system path) gives the same energy and forces."""
    import halopipe.models.ewald as ewald_module

    system = random_ionic_cell(n_cells=2, seed=9)
    model = Ewald(cutoff=5.0, accuracy=1e-8)
    ref = energy(model, system)
    monkeypatch.setattr(ewald_module, "_CHUNK_ELEMENTS", 7 * system.n_atoms)
    out = energy(model, system)
    assert float(out["energy"]) == pytest.approx(float(ref["energy"]), rel=1e-13)
    torch.testing.assert_close(out["forces"], ref["forces"], rtol=0, atol=1e-12)
