"""DFT-D3 against s-dftd3 (the reference implementation's Python API), single process, float64.

Every comparison builds the same system for s-dftd3 (bohr in, Hartree out,
converted with ``ase.units``) with the same real-space cutoffs on both sides and
the damping parameters loaded by s-dftd3 from its own parameter file, so the
packaged reference tables and functional parameters are checked as well as the
formulas. s-dftd3's ``virial`` is ``dE/d(strain)``, i.e. ``stress * volume``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from ase import Atoms, units
from ase.build import bulk, molecule
from ase.geometry import cellpar_to_cell

from halopipe.models.dftd3 import DEFAULT_ATM_CUTOFF, DEFAULT_CN_CUTOFF, DEFAULT_CUTOFF, DFTD3, known_functionals
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System
from halopipe.testing import check_model

dftd3_interface = pytest.importorskip("dftd3.interface")  # s-dftd3, the reference
pytestmark = pytest.mark.timeout(300)

# Cutoffs for the comparisons (Å), smaller than the defaults for speed; non-round so no
# crystal distance sits on a cutoff.
CUT2, CUT_CN, CUT3 = 16.3, 10.7, 9.3
E_REL, F_TOL, W_TOL = 1e-7, 1e-6, 1e-6  # energy relative; gradient eV/Å; virial eV


# ----------------------------------------------------------------------- systems
def _replace(atoms: Atoms, old: str, new: str, bond: float | None = None) -> Atoms:
    """Swap element ``old`` for ``new``, optionally stretching its bond to the first neighbour."""
    atoms = atoms.copy()
    symbols = atoms.get_chemical_symbols()
    idx = [k for k, s in enumerate(symbols) if s == old]
    for k in idx:
        symbols[k] = new
    atoms.set_chemical_symbols(symbols)
    if bond is not None:
        for k in idx:
            d = atoms.get_distances(k, range(len(atoms)))
            d[k] = np.inf
            n = int(np.argmin(d))
            v = atoms.positions[k] - atoms.positions[n]
            atoms.positions[k] = atoms.positions[n] + v / np.linalg.norm(v) * bond
    return atoms


def _scaled(atoms: Atoms, old: str, new: str, factor: float) -> Atoms:
    atoms = _replace(atoms, old, new)
    atoms.positions *= factor
    return atoms


def _heavy_cluster() -> Atoms:
    """Heavy and exotic elements (Br, I, Sn, Pb, Au, Fe, La, U) with H/C/O neighbours."""
    rng = np.random.default_rng(3)
    symbols = ["Br", "I", "Sn", "Pb", "Au", "Fe", "La", "U", "C", "O", "H", "H"]
    grid = np.array([[x, y, z] for x in range(3) for y in range(2) for z in range(2)], dtype=float) * 2.6
    return Atoms(symbols, positions=grid + rng.uniform(-0.25, 0.25, grid.shape))


def _all_elements() -> Atoms:
    """One atom of every element H..Lr on a jittered grid: exercises the whole reference table."""
    rng = np.random.default_rng(11)
    grid = np.array([[x, y, z] for x in range(5) for y in range(5) for z in range(5)], dtype=float)[:103] * 3.1
    return Atoms(numbers=np.arange(1, 104), positions=grid + rng.uniform(-0.3, 0.3, grid.shape))


MOLECULES = {
    "ethanol": lambda: molecule("CH3CH2OH"),
    "benzene": lambda: molecule("C6H6"),
    "water": lambda: molecule("H2O"),
    "acetic_acid": lambda: molecule("CH3COOH"),
    "dmso": lambda: molecule("C2H6SO"),
    "sicl4": lambda: molecule("SiCl4"),
    "bromomethane": lambda: _replace(molecule("CH3Cl"), "Cl", "Br", 1.94),
    "iodomethane": lambda: _replace(molecule("CH3Cl"), "Cl", "I", 2.14),
    "stannane": lambda: _scaled(molecule("SiH4"), "Si", "Sn", 1.15),
    "plumbane": lambda: _scaled(molecule("SiH4"), "Si", "Pb", 1.18),
    "au_cl": lambda: Atoms("AuClAu", positions=[[0, 0, 0], [2.3, 0, 0], [4.0, 1.6, 0.3]]),
    "heavy_cluster": _heavy_cluster,
}


def _triclinic() -> Atoms:
    cell = cellpar_to_cell([5.1, 5.9, 6.4, 78.0, 95.0, 106.0])
    frac = np.array([[0.1, 0.2, 0.3], [0.55, 0.45, 0.2], [0.3, 0.8, 0.7], [0.8, 0.1, 0.6], [0.6, 0.6, 0.9]])
    return Atoms("CO2BrPb", scaled_positions=frac, cell=cell, pbc=True)


def _water_box() -> Atoms:
    """A sparse molecular crystal (one water in a triclinic cell): cheap even at the default cutoffs."""
    atoms = molecule("H2O")
    atoms.cell = cellpar_to_cell([7.3, 7.6, 7.9, 84.0, 97.0, 101.0])
    atoms.pbc = True
    atoms.positions += 2.0
    return atoms


CRYSTALS = {
    "si_diamond": lambda: bulk("Si", "diamond", a=5.43),
    "nacl": lambda: bulk("NaCl", "rocksalt", a=5.64),
    "cu_fcc_primitive": lambda: bulk("Cu", "fcc", a=3.61),
    "zno_wurtzite": lambda: bulk("ZnO", "wurtzite", a=3.25, c=5.21),
    "graphite": lambda: Atoms(
        "C4",
        scaled_positions=[[0, 0, 0.25], [0, 0, 0.75], [1 / 3, 2 / 3, 0.25], [2 / 3, 1 / 3, 0.75]],
        cell=cellpar_to_cell([2.46, 2.46, 6.7, 90, 90, 120]),
        pbc=True,
    ),
    "triclinic": _triclinic,
    "water_box": _water_box,
}


# -------------------------------------------------------------------- evaluation
def reference(atoms: Atoms, functional: str, damping: str, s9: float, cutoffs=(CUT2, CUT_CN, CUT3)) -> dict:
    """s-dftd3 energy (eV), gradient (eV/Å) and dE/dstrain (eV)."""
    periodic = bool(atoms.pbc.any())
    model = dftd3_interface.DispersionModel(
        atoms.numbers,
        atoms.positions / units.Bohr,
        atoms.cell.array / units.Bohr if periodic else None,
        np.asarray(atoms.pbc) if periodic else None,
    )
    cut2, cut_cn, cut3 = (c / units.Bohr for c in cutoffs)
    model.set_realspace_cutoff(cut2, cut3, cut_cn)
    kind = dftd3_interface.RationalDampingParam if damping == "bj" else dftd3_interface.ZeroDampingParam
    # s-dftd3 loads its published parameters with s9 = 0 (atm=False) or s9 = 1 (atm=True);
    # the ATM term is linear in s9, so any other s9 is their linear combination.
    two = model.get_dispersion(kind(method=functional, atm=False), grad=True)
    both = model.get_dispersion(kind(method=functional, atm=True), grad=True) if s9 != 0.0 else two
    out = {k: (1.0 - s9) * np.asarray(two[k]) + s9 * np.asarray(both[k]) for k in ("energy", "gradient", "virial")}
    return {
        "energy": float(out["energy"]) * units.Hartree,
        "gradient": out["gradient"] * units.Hartree / units.Bohr,
        "strain_derivative": out["virial"] * units.Hartree,
    }


def ours(atoms: Atoms, functional: str, damping: str, s9: float, cutoffs=(CUT2, CUT_CN, CUT3)) -> dict:
    model = DFTD3(functional, damping, cutoff=cutoffs[0], cn_cutoff=cutoffs[1], s9=s9, atm_cutoff=cutoffs[2])
    system = System.from_ase(atoms)
    return Pipeline([Group([Step(model)], autograd=True)])(system, stress=bool(atoms.pbc.all()))


def compare(atoms: Atoms, functional: str, damping: str, s9: float, **kw) -> None:
    ref, got = reference(atoms, functional, damping, s9, **kw), ours(atoms, functional, damping, s9, **kw)
    e_rel = abs(float(got["energy"]) - ref["energy"]) / abs(ref["energy"])
    f_err = float(np.abs(got["forces"].numpy() + ref["gradient"]).max())
    assert e_rel < E_REL, f"energy {float(got['energy'])} vs s-dftd3 {ref['energy']} (rel {e_rel:.2e})"
    assert f_err < F_TOL, f"gradient differs by {f_err:.2e} eV/Å"
    if atoms.pbc.all():
        # stress = (1/V) dE/dstrain (ASE sign convention), s-dftd3's virial is dE/dstrain.
        w_err = float(np.abs(got["stress"].numpy() * atoms.get_volume() - ref["strain_derivative"]).max())
        assert w_err < W_TOL, f"virial differs by {w_err:.2e} eV"


# ------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", sorted(MOLECULES))
@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_molecules_against_sdftd3(name: str, damping: str) -> None:
    compare(MOLECULES[name](), "pbe0" if damping == "bj" else "b3lyp", damping, 0.0)


@pytest.mark.parametrize("name", sorted(CRYSTALS))
@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_crystals_against_sdftd3(name: str, damping: str) -> None:
    compare(CRYSTALS[name](), "pbe" if damping == "bj" else "revpbe", damping, 0.0)


@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_whole_reference_table(damping: str) -> None:
    """Every element 1..103 at once: C6 table, reference CNs, radii, <r4>/<r2>."""
    compare(_all_elements(), "pbe", damping, 0.0)


@pytest.mark.parametrize("functional", ["pbe", "pbe0", "b3lyp", "revpbe", "r2scan", "tpss", "blyp"])
@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_functionals(functional: str, damping: str) -> None:
    if functional not in known_functionals(damping):
        # r2SCAN has no published zero-damping parameters: the error is the check.
        with pytest.raises(ValueError, match="no published"):
            DFTD3(functional, damping)
        return
    compare(MOLECULES["iodomethane"](), functional, damping, 0.0)


@pytest.mark.parametrize(
    "system,damping,s9",
    [
        ("ethanol", "bj", 1.0),
        ("heavy_cluster", "zero", 1.0),
        ("si_diamond", "bj", 1.0),
        ("triclinic", "zero", 0.7),
        ("graphite", "bj", 1.0),
    ],
)
def test_atm_against_sdftd3(system: str, damping: str, s9: float) -> None:
    atoms = (MOLECULES | CRYSTALS)[system]()
    compare(atoms, "b3lyp" if damping == "bj" else "pbe", damping, s9)


@pytest.mark.parametrize("system", ["si_diamond", "graphite"])
def test_atm_in_small_chunks_against_sdftd3(system: str, monkeypatch) -> None:
    """The ghost-row path (no Warp): chunks of about 500 candidate triples (one per atom, recomputed in the backward)."""
    import halopipe.models.dftd3 as d3

    monkeypatch.setattr(d3.DFTD3, "lattice", property(lambda self: False))  # as without Warp
    counted = []
    chunks = d3._chunks_of_triples
    monkeypatch.setattr(d3, "TRIPLE_CHUNK", 500)
    monkeypatch.setattr(d3, "_chunks_of_triples", lambda *a: counted.append(len(chunks(*a))) or chunks(*a))
    atoms = CRYSTALS[system]()
    compare(atoms, "b3lyp", "bj", 1.0)
    assert max(counted) == len(atoms) > 1, counted  # every centre has more than 500 candidate triples


@pytest.mark.timeout(120)
def test_default_cutoffs_periodic() -> None:
    """Default cutoffs (LAMMPS two-body and CN, s-dftd3 ATM) on a sparse periodic system, with ATM."""
    model = DFTD3()
    assert math.isclose(model.disp2_cutoff, math.sqrt(9000) * units.Bohr) and math.isclose(model.cn_cutoff, 40 * units.Bohr)
    assert math.isclose(model.atm_cutoff, 40 * units.Bohr)
    assert model.interaction_cutoff == pytest.approx(DEFAULT_CUTOFF)
    compare(CRYSTALS["water_box"](), "pbe", "bj", 1.0, cutoffs=(DEFAULT_CUTOFF, DEFAULT_CN_CUTOFF, DEFAULT_ATM_CUTOFF))


def test_cutoff_attribute_covers_every_term() -> None:
    assert DFTD3(cutoff=8.0, cn_cutoff=11.0).interaction_cutoff == 11.0
    assert DFTD3(cutoff=8.0, cn_cutoff=6.0, s9=1.0, atm_cutoff=9.0).interaction_cutoff == 9.0
    assert DFTD3(cutoff=8.0, cn_cutoff=6.0, s9=0.0, atm_cutoff=9.0).interaction_cutoff == 8.0


def test_halo_of_lattice_sums_and_of_ghost_rows(monkeypatch) -> None:
    """Lattice sums (with or without ATM) need no ghost rows; without Warp the view's rows reach every term's cutoff."""
    plain, atm = DFTD3(cutoff=50.0, cn_cutoff=21.0), DFTD3(cutoff=8.0, cn_cutoff=6.0, s9=1.0, atm_cutoff=9.0)
    for model in (plain, atm):
        assert model.lattice and model.halo == 0.0 and not model.ghost_forces
    monkeypatch.setattr(DFTD3, "lattice", property(lambda self: False))  # as without Warp
    assert plain.halo == 50.0 and atm.halo == 9.0 and atm.ghost_forces


def test_conformance_periodic() -> None:
    model = DFTD3("pbe", "bj", cutoff=9.1, cn_cutoff=7.3, s9=1.0, atm_cutoff=6.2)
    check_model(model, System.from_ase(CRYSTALS["triclinic"]()), n_fd_atoms=2, force_atol=1e-6, stress_atol=1e-7)


@pytest.mark.parametrize("damping", ["bj", "zero"])
def test_conformance_lattice_sums(damping: str) -> None:
    """The lattice-sum path (no ATM) on a small triclinic cell whose cutoffs span several images along every axis."""
    model = DFTD3("pbe" if damping == "bj" else "b3lyp", damping, cutoff=17.3, cn_cutoff=11.1)
    assert model.lattice
    check_model(model, System.from_ase(CRYSTALS["triclinic"]()), n_fd_atoms=2, force_atol=1e-6, stress_atol=1e-7)


def test_conformance_molecule() -> None:
    model = DFTD3("b3lyp", "zero", cutoff=12.0, cn_cutoff=9.0, s9=1.0, atm_cutoff=8.0)
    check_model(model, System.from_ase(MOLECULES["heavy_cluster"]()), n_fd_atoms=3, force_atol=1e-6)


def _distributed_setup():
    system = System.from_ase(_triclinic().repeat((3, 2, 1)))
    return system, DFTD3("pbe", "zero", cutoff=9.3, cn_cutoff=6.1, s9=1.0, atm_cutoff=7.2)


def _distributed_worker(grid: tuple[int, int, int]):
    """One rank: scatter, evaluate, gather the forces."""
    import torch.distributed as dist

    from halopipe.distributed import DomainConfig, ShardedSystem

    system, model = _distributed_setup()
    config = DomainConfig(grid=grid)
    sharded = ShardedSystem.scatter(system if dist.get_rank() == 0 else None, config)
    out = Pipeline([model], config=config)(sharded, stress=True)
    return float(out["energy"]), sharded.gather(out["forces"]).numpy(), out["stress"].numpy()


@pytest.mark.timeout(180)
def test_domain_decomposition_matches_single_process() -> None:
    """Two ranks: ghost CNs arrive through refresh, ATM triples are counted once."""
    launch = pytest.importorskip("halopipe.distributed.launch")
    system, model = _distributed_setup()
    ref = Pipeline([Group([Step(model)], autograd=True)])(system, stress=True)
    for energy, forces, stress in launch.spawn(_distributed_worker, 2, (2, 1, 1), timeout=150.0):
        assert abs(energy - float(ref["energy"])) <= 1e-10 * abs(float(ref["energy"]))
        np.testing.assert_allclose(forces, ref["forces"].numpy(), atol=1e-10, rtol=0)
        np.testing.assert_allclose(stress, ref["stress"].numpy(), atol=1e-12, rtol=0)


def test_non_periodic_system_has_zero_cell() -> None:
    atoms = molecule("C6H6")
    system = System.from_ase(atoms)
    assert not bool(system.pbc.any()) and float(system.cell.abs().max()) == 0.0
    compare(atoms, "pbe", "bj", 1.0)


def test_unknown_functional() -> None:
    with pytest.raises(ValueError, match="unknown functional 'pbeq'.*pbe0"):
        DFTD3("pbeq")
    with pytest.raises(ValueError, match="unknown damping"):
        DFTD3("pbe", damping="bjm")
    with pytest.raises(ValueError, match="cutoff"):
        DFTD3(cutoff=-1.0)


def test_aliases_and_overrides() -> None:
    assert DFTD3("PBEh").params == DFTD3("pbe0").params  # s-dftd3 alias, case-insensitive
    model = DFTD3("pbe", params={"s8": 0.5})
    assert model.params["s8"] == 0.5 and model.params["a1"] == DFTD3("pbe").params["a1"]
    with pytest.raises(ValueError, match="unknown parameter"):
        DFTD3("pbe", params={"rs6": 1.0})


def test_element_beyond_table() -> None:
    atoms = Atoms(numbers=[6, 104], positions=[[0, 0, 0], [2.0, 0, 0]])
    with pytest.raises(ValueError, match="atomic number 104"):
        ours(atoms, "pbe", "bj", 0.0)
