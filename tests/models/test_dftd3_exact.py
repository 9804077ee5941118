"""DFT-D3 equals s-dftd3 to 1e-9 relative (float64): energy, forces and stress, at both cutoff conventions.

Reference: s-dftd3 (Grimme group's reference implementation, through its Python API ``dftd3.interface``),
called as in ``tests/models/test_dftd3.py``: positions in bohr (``ase.units.Bohr``), Hartree out,
damping parameters loaded by s-dftd3 from its own parameter file, ``virial`` = dE/d(strain) =
stress * volume, and a ``periodic`` array for slabs. Tolerances: |dE| <= 1e-9 |E|,
max |dF| <= 1e-9 max |F|, max |dW| <= 1e-9 max |W| (W = stress * cell volume); no absolute floor.

Cutoff conventions (the only way the two differ is the two-body cutoff):

* s-dftd3's defaults (read from its library, not set here: two-body 60 bohr ≈ 31.75 Å, CN 40 bohr,
  ATM 40 bohr), matched by ``DFTD3(cutoff=60 bohr, cn_cutoff=40 bohr, atm_cutoff=40 bohr)``;
* halopipe's defaults, ``DFTD3()``: two-body sqrt(9000) bohr ≈ 50.2 Å, CN sqrt(1600) = 40 bohr,
  ATM 40 bohr, passed to s-dftd3 with ``set_realspace_cutoff``.

Length convention. s-dftd3 tabulates the covalent radii of the CN and the zero/ATM damping radii R0AB in
Å and converts them with mctc-lib's bohr, hbar / (m_e c alpha) from CODATA 2018, while the positions reach it
through ASE's CODATA 2014 bohr: relative to the positions its radii are 6.4e-10 shorter than tabulated, which
the steep CN step (k1 = 16) and the zero damping amplify into ~5e-8 relative in forces. halopipe takes the
radii so (``halopipe.models.dftd3.SDFTD3_LENGTH``; ``test_length_convention`` computes the ratio from the
CODATA 2018 constants independently), and agrees with s-dftd3 to ~1e-13 relative.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import bulk, molecule
from ase.geometry import cellpar_to_cell
from ase.spacegroup import crystal

from halopipe.models import dftd3 as d3
from halopipe.models.dftd3 import DFTD3
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System

dftd3_interface = pytest.importorskip("dftd3.interface")  # s-dftd3, the reference
pytestmark = pytest.mark.timeout(300)

REL = 1e-9

# mctc-lib (s-dftd3's unit library): bohr = hbar / (m_e c alpha), CODATA 2018, in Å.
SDFTD3_BOHR = 6.62607015e-34 / (2.0 * math.pi) / (9.1093837015e-31 * 299792458.0 * 7.2973525693e-3) * 1e10
LENGTH_RATIO = units.Bohr / SDFTD3_BOHR  # s-dftd3's Å-tabulated radii, in the Å of the positions (1 - 6.4e-10)

SDFTD3_CUTOFFS = (60.0 * units.Bohr, 40.0 * units.Bohr, 40.0 * units.Bohr)  # two-body, CN, ATM (Å)
HALOPIPE_CUTOFFS = (math.sqrt(9000.0) * units.Bohr, math.sqrt(1600.0) * units.Bohr, 40.0 * units.Bohr)


# ----------------------------------------------------------------------- systems
def chno_molecules() -> Atoms:
    """Acetamide, nitromethane and benzene, 28 atoms of C/H/N/O, a few Å apart (no cell)."""
    a, b, c = molecule("CH3CONH2"), molecule("CH3NO2"), molecule("C6H6")
    b.positions += [0.5, 3.6, 0.4]
    c.positions += [-1.0, -1.0, 4.2]
    return a + b + c


def urea_crystal() -> Atoms:
    """Urea, P-42_1m, 2 molecules (16 atoms of C/H/N/O) in a 5.57 x 5.57 x 4.68 Å cell, rattled by 0.02 Å."""
    atoms = crystal(
        ["C", "O", "N", "H", "H"],
        basis=[(0, 0.5, 0.326), (0, 0.5, 0.5953), (0.1459, 0.6459, 0.1766), (0.2575, 0.7575, 0.2827), (0.1441, 0.6441, -0.038)],
        spacegroup=113,
        cellpar=[5.565, 5.565, 4.684, 90, 90, 90],
    )
    atoms.rattle(0.02, seed=4)
    return atoms


def si_diamond() -> Atoms:
    atoms = bulk("Si", "diamond", a=5.43, cubic=True)  # 8 atoms
    atoms.rattle(0.05, seed=1)
    return atoms


def si_primitive() -> Atoms:
    """Diamond Si, 2-atom primitive cell (60° angles), one atom displaced: the ATM case at default cutoffs."""
    atoms = bulk("Si", "diamond", a=5.43)
    atoms.positions[1] += [0.07, -0.04, 0.05]
    return atoms


def rutile(repeat=(1, 1, 2)) -> Atoms:
    """Rutile TiO2 (a = 4.594, c = 2.959 Å, x(O) = 0.305), rattled by 0.04 Å."""
    atoms = crystal(["Ti", "O"], basis=[(0, 0, 0), (0.305, 0.305, 0)], spacegroup=136, cellpar=[4.594, 4.594, 2.959, 90, 90, 90])
    atoms = atoms.repeat(repeat)
    atoms.rattle(0.04, seed=5)
    return atoms


def mgo_slab() -> Atoms:
    """MgO(100), 4 layers of the cubic cell (16 atoms), 15 Å of vacuum along z, periodic in x and y only."""
    atoms = bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((1, 1, 2))
    atoms.center(vacuum=7.5, axis=2)
    atoms.pbc = [True, True, False]
    atoms.rattle(0.04, seed=2)
    return atoms


def mgo_slab_thin() -> Atoms:
    """MgO(100), 2 layers of the 2.98 Å square surface cell (4 atoms), 15 Å of vacuum: the ATM slab."""
    side, layer = 4.21 / math.sqrt(2.0), 4.21 / 2.0
    positions = [[0, 0, 0], [side / 2, side / 2, 0], [side / 2, side / 2, layer], [0, 0, layer]]
    atoms = Atoms("MgOMgO", positions=positions, cell=[side, side, 2 * layer], pbc=True)
    atoms.center(vacuum=7.5, axis=2)
    atoms.pbc = [True, True, False]
    atoms.rattle(0.04, seed=3)
    return atoms


def triclinic() -> Atoms:
    """5 atoms (Si, C, N, O, Ti) in a 5.3 x 6.1 x 6.8 Å cell with angles 63°, 112°, 72° (heights 4.0-4.8 Å)."""
    cell = cellpar_to_cell([5.3, 6.1, 6.8, 63.0, 112.0, 72.0])
    frac = np.array([[0.1, 0.2, 0.3], [0.45, 0.4, 0.25], [0.3, 0.75, 0.7], [0.8, 0.15, 0.6], [0.6, 0.6, 0.95]])
    return Atoms("SiCNOTi", scaled_positions=frac, cell=cell, pbc=True)


SYSTEMS = {
    "chno_molecules": chno_molecules,
    "urea_crystal": urea_crystal,
    "si_diamond": si_diamond,
    "si_primitive": si_primitive,
    "rutile": rutile,
    "rutile_primitive": lambda: rutile((1, 1, 1)),
    "mgo_slab": mgo_slab,
    "mgo_slab_thin": mgo_slab_thin,
    "triclinic": triclinic,
}
FUNCTIONAL = {"bj": "pbe0", "zero": "b3lyp"}


# -------------------------------------------------------------------- evaluation
def reference(atoms: Atoms, damping: str, s9: float, convention: str) -> dict:
    """s-dftd3: energy (eV), forces (eV/Å), dE/dstrain (eV)."""
    periodic = bool(atoms.pbc.any())
    model = dftd3_interface.DispersionModel(
        atoms.numbers,
        atoms.positions / units.Bohr,
        atoms.cell.array / units.Bohr if periodic else None,
        np.asarray(atoms.pbc) if periodic else None,
    )
    if convention == "halopipe":
        cut2, cut_cn, cut3 = (c / units.Bohr for c in HALOPIPE_CUTOFFS)
        model.set_realspace_cutoff(cut2, cut3, cut_cn)
    kind = dftd3_interface.RationalDampingParam if damping == "bj" else dftd3_interface.ZeroDampingParam
    assert s9 in (0.0, 1.0)  # s-dftd3's published parameters come with s9 = 0 (atm=False) or 1
    out = model.get_dispersion(kind(method=FUNCTIONAL[damping], atm=s9 == 1.0), grad=True)
    return {
        "energy": float(out["energy"]) * units.Hartree,
        "forces": -np.asarray(out["gradient"]) * units.Hartree / units.Bohr,
        "virial": np.asarray(out["virial"]) * units.Hartree,
    }


def halopipe_model(damping: str, s9: float, convention: str) -> DFTD3:
    if convention == "halopipe":
        return DFTD3(FUNCTIONAL[damping], damping, s9=s9)  # the defaults under test
    cut2, cut_cn, cut3 = SDFTD3_CUTOFFS
    return DFTD3(FUNCTIONAL[damping], damping, cutoff=cut2, cn_cutoff=cut_cn, s9=s9, atm_cutoff=cut3)


def ours(atoms: Atoms, model: DFTD3) -> dict:
    periodic = bool(atoms.pbc.any())
    out = Pipeline([Group([Step(model)], autograd=True)])(System.from_ase(atoms), stress=periodic)
    got = {"energy": float(out["energy"]), "forces": out["forces"].numpy()}
    if periodic:  # stress is dE/dstrain over the cell's volume (the vacuum axis's length counts for a slab)
        got["virial"] = out["stress"].numpy() * abs(np.linalg.det(atoms.cell.array))
    return got


def errors(atoms: Atoms, damping: str, s9: float, convention: str) -> dict:
    """Relative differences to s-dftd3 (forces and virial scaled by their largest component)."""
    got, ref = ours(atoms, halopipe_model(damping, s9, convention)), reference(atoms, damping, s9, convention)
    err = {
        "energy": abs(got["energy"] - ref["energy"]) / abs(ref["energy"]),
        "forces": float(np.abs(got["forces"] - ref["forces"]).max() / np.abs(ref["forces"]).max()),
    }
    if "virial" in got:
        err["virial"] = float(np.abs(got["virial"] - ref["virial"]).max() / np.abs(ref["virial"]).max())
    return err


def check(name: str, damping: str, s9: float, convention: str) -> None:
    err = errors(SYSTEMS[name](), damping, s9, convention)
    print(name, damping, s9, convention, {k: f"{v:.1e}" for k, v in err.items()})
    assert all(v <= REL for v in err.values()), f"{name} {damping} s9={s9} {convention} cutoffs: relative errors {err} (limit {REL})"


# ------------------------------------------------------------------------- tests
TWO_BODY = ["chno_molecules", "urea_crystal", "si_diamond", "rutile", "mgo_slab", "triclinic"]


@pytest.mark.parametrize("convention", ["sdftd3", "halopipe"])
@pytest.mark.parametrize("damping", ["bj", "zero"])
@pytest.mark.parametrize("name", TWO_BODY)
def test_two_body(name: str, damping: str, convention: str) -> None:
    check(name, damping, 0.0, convention)


# ATM costs (neighbours within 21.2 Å)^2 per atom: the smallest cells, each periodic one at one convention per
# damping (the ATM cutoff is 40 bohr in both; they differ in the two-body cutoff only).
ATM = [
    ("chno_molecules", "bj", "sdftd3"),
    ("chno_molecules", "bj", "halopipe"),
    ("chno_molecules", "zero", "sdftd3"),
    ("chno_molecules", "zero", "halopipe"),
    ("triclinic", "bj", "sdftd3"),
    ("triclinic", "zero", "halopipe"),
    ("si_primitive", "bj", "halopipe"),
    ("si_primitive", "zero", "sdftd3"),
    ("mgo_slab_thin", "bj", "halopipe"),
    ("mgo_slab_thin", "zero", "sdftd3"),
    ("rutile_primitive", "bj", "sdftd3"),  # the slowest, ~20 s: 6 dense atoms, all triples within 40 bohr
]


@pytest.mark.parametrize("name,damping,convention", ATM)
def test_with_atm(name: str, damping: str, convention: str) -> None:
    check(name, damping, 1.0, convention)


def test_cutoff_conventions() -> None:
    """halopipe's defaults are the stated ones; the triclinic cell's cutoffs span several images along every axis."""
    model = DFTD3()
    assert (model.disp2_cutoff, model.cn_cutoff, model.atm_cutoff) == pytest.approx(HALOPIPE_CUTOFFS, rel=1e-15)
    heights = 1.0 / np.linalg.norm(np.linalg.inv(triclinic().cell.array), axis=0)
    assert heights.max() < 5.0 and min(SDFTD3_CUTOFFS[0], HALOPIPE_CUTOFFS[0]) / heights.max() > 6, heights
    angles = triclinic().cell.cellpar()[3:]
    assert np.abs(angles - 90.0).min() > 15.0, angles


def test_length_convention() -> None:
    """The model's covalent radii and R0AB are the tabulated Å values in s-dftd3's length (see the module docstring)."""
    model, ref = DFTD3(), d3._reference()
    assert SDFTD3_BOHR == pytest.approx(0.5291772109044924, rel=1e-15) and 6.3e-10 < 1.0 - LENGTH_RATIO < 6.5e-10
    assert torch.allclose(model.rcov, torch.as_tensor(d3.K2 * ref["rcov"] * LENGTH_RATIO), rtol=1e-15, atol=0.0)
    assert torch.allclose(model.r0ab, torch.as_tensor(ref["r0ab"] * LENGTH_RATIO), rtol=1e-15, atol=0.0)


# --------------------------------------------------------------------- bad input
@pytest.mark.parametrize("z", [104, 118])
def test_element_without_reference_data(z: int) -> None:
    atoms = Atoms(numbers=[6, z, 1], positions=[[0, 0, 0], [2.2, 0, 0], [0, 1.1, 0]])
    with pytest.raises(ValueError, match=rf"atomic number {z}\b.*1\.\.103.*leave D3 out"):
        ours(atoms, DFTD3("pbe", cutoff=8.0, cn_cutoff=6.0))


def test_atomic_number_zero() -> None:
    """Z = 0 (ASE's dummy atom "X") is refused with its value named (by System, before D3 sees it)."""
    atoms = Atoms(numbers=[6, 0], positions=[[0, 0, 0], [2.0, 0, 0]])
    with pytest.raises(ValueError, match=r"atomic number 0\b"):
        ours(atoms, DFTD3("pbe", cutoff=8.0, cn_cutoff=6.0))


@pytest.mark.parametrize("label", ["cutoff", "cn_cutoff", "atm_cutoff"])
@pytest.mark.parametrize("value", [0.0, -2.5, float("nan"), float("inf"), -float("inf"), "abc", None])
def test_bad_cutoffs(label: str, value) -> None:
    with pytest.raises(ValueError) as info:
        DFTD3("pbe", s9=1.0, **{label: value})
    message = str(info.value)
    assert f"{label} must be" in message and repr(value) in message and "positive" in message, message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_bad_s9(value: float) -> None:
    with pytest.raises(ValueError, match=rf"s9 must be a finite number, got {value!r}"):
        DFTD3("pbe", s9=value)


def test_unknown_damping_names_the_value_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown damping 'bjm'.*'bj'.*'zero'"):
        DFTD3("pbe", damping="bjm")


def test_unknown_functional_names_the_value_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown functional 'pbe-d9'.*b3lyp.*pbe0"):
        DFTD3("pbe-d9")
