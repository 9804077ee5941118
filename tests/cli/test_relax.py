"""``halopipe relax`` end to end, through :func:`halopipe.cli.main`, against independent references.

References: ASE's Lennard-Jones calculator (argon) and a NumPy Lorentz-Berthelot Lennard-Jones below (the Cu/Ar
frame), evaluated at the relaxed structures the command writes; the minima are known without any optimiser (a
rattled crystal relaxes back to its perfect lattice at fixed cell; under ``--cell``, to the fcc lattice constant
where ASE's stress equals minus the pressure). Tolerances follow from the force criterion: near a minimum with
Hessian ``H`` (smallest non-zero eigenvalue ``lam``, from finite differences of the reference forces), residual
forces ``F`` leave the energy ``F.H+.F / 2 <= |F|^2 / (2 lam)`` above it and the atoms ``|F| / lam`` away from it;
a factor 2 covers the anharmonic rest. ASE's own FIRE with ASE's calculator, run to the same ``--fmax``, must land
within the same bound of the same minimum.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from ase import Atoms
from ase.build import bulk
from ase.calculators.calculator import Calculator, all_changes
from ase.calculators.lj import LennardJones as AseLJ
from ase.filters import FrechetCellFilter
from ase.neighborlist import neighbor_list
from ase.optimize import FIRE
from scipy.optimize import brentq

from halopipe.cli import main

EPS = {"Ar": 0.0104, "Cu": 0.4093}  # eV
SIGMA = {"Ar": 3.4, "Cu": 2.338}  # Å
RC, A_AR, A_CUAR3 = 8.5, 5.26, 4.8
FMAX = 1e-3  # eV/Å: tight, so that the bounds below are small (at the default 0.05 argon stays ~0.05 eV above its minimum)


class MixedLJ(Calculator):
    """Lennard-Jones with Lorentz-Berthelot mixing, shifted to zero at the cutoff (energy and forces), in NumPy."""

    implemented_properties = ["energy", "forces"]

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        super().calculate(atoms, properties, system_changes)
        i, j, d, vec = neighbor_list("ijdD", self.atoms, RC)  # every pair from both ends
        symbols = np.array(self.atoms.get_chemical_symbols())
        eps = np.sqrt([EPS[a] * EPS[b] for a, b in zip(symbols[i], symbols[j])])
        sigma = np.array([0.5 * (SIGMA[a] + SIGMA[b]) for a, b in zip(symbols[i], symbols[j])])
        sr6, sc6 = (sigma / d) ** 6, (sigma / RC) ** 6
        energy = 0.5 * np.sum(4 * eps * (sr6**2 - sr6) - 4 * eps * (sc6**2 - sc6))
        de_dd = 4 * eps * (6 * sr6 - 12 * sr6**2) / d
        forces = np.zeros((len(self.atoms), 3))
        np.add.at(forces, i, (de_dd / d)[:, None] * vec)  # -dE/dr_i, vec = r_j - r_i
        self.results = {"energy": energy, "forces": forces}


def ase_lj() -> AseLJ:
    return AseLJ(epsilon=EPS["Ar"], sigma=SIGMA["Ar"], rc=RC)


def argon(repeat, a: float = A_AR) -> Atoms:
    return bulk("Ar", "fcc", a=a, cubic=True).repeat(repeat)


def cu_ar3(repeat) -> Atoms:
    """L1_2 CuAr3 (every atom on an inversion centre, so the perfect lattice is a minimum: checked by the Hessian)."""
    cell = Atoms("CuAr3", scaled_positions=[[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]], cell=[A_CUAR3] * 3, pbc=True)
    return cell.repeat(repeat)


def rattled(atoms: Atoms, seed: int, scale: float = 0.1) -> Atoms:
    atoms = atoms.copy()
    atoms.rattle(scale, seed=seed)
    return atoms


def smallest_curvature(atoms: Atoms, calc, h: float = 1e-4) -> float:
    """The smallest Hessian eigenvalue of ``atoms`` above the three translations, eV/Å², by central differences."""
    atoms = atoms.copy()
    atoms.calc = calc
    x0 = atoms.positions.copy()
    hessian = np.zeros((x0.size, x0.size))
    for k in range(x0.size):
        for sign in (1, -1):
            x = x0.copy()
            x.flat[k] += sign * h
            atoms.positions = x
            hessian[k] -= sign * atoms.get_forces().ravel() / (2 * h)
    values = np.linalg.eigvalsh(0.5 * (hessian + hessian.T))
    assert np.abs(values[:3]).max() < 1e-8 and values[3] > 0.01, values[:4]  # translations, then a true minimum
    return values[3]


def write_potential(path, elements=("Ar", "Cu")):
    model = {"type": "LennardJones", "epsilon": {e: EPS[e] for e in elements}, "sigma": {e: SIGMA[e] for e in elements}, "cutoff": RC}
    path.write_text(yaml.safe_dump({"models": {"lj": model}}))
    return path


def write_frames(path, frames):
    import ase.io

    ase.io.write(path, frames, format="extxyz")
    return path


def read_frames(path):
    import ase.io

    return ase.io.read(path, index=":")


def table(stdout: str) -> list[list[str]]:
    """The summary's rows after the header, split into columns."""
    lines = stdout.strip().splitlines()
    header = next(k for k, line in enumerate(lines) if line.split()[:2] == ["frame", "atoms"])
    return [line.split() for line in lines[header + 1 :]]


def reference_forces(atoms: Atoms, calc) -> tuple[np.ndarray, float]:
    """Reference forces of ``atoms`` and the largest row norm."""
    atoms = atoms.copy()
    atoms.calc = calc
    forces = atoms.get_forces()
    return forces, float(np.linalg.norm(forces, axis=1).max())


@pytest.mark.timeout(120)
def test_relaxes_every_frame_to_its_minimum(tmp_path, capsys):
    perfect = [argon(2), argon((2, 2, 3)), cu_ar3(2)]  # 32, 48 and 32 atoms
    calcs = [ase_lj, ase_lj, MixedLJ]
    start = [rattled(p, seed) for seed, p in enumerate(perfect)]
    structures = write_frames(tmp_path / "in.extxyz", start)
    out = tmp_path / "relaxed.extxyz"
    assert (
        main(["relax", str(structures), "-o", str(out), "--config", str(write_potential(tmp_path / "lj.yaml")), "--fmax", str(FMAX)]) == 0
    )
    captured = capsys.readouterr()
    assert "3/3" in captured.err  # the progress bar went to stderr
    rows = table(captured.out)
    relaxed = read_frames(out)
    assert [r[:3] for r in rows] == [[str(k), str(len(p)), "yes"] for k, p in enumerate(perfect)]
    assert [a.info["frame"] for a in relaxed] == [0, 1, 2]
    for k, (atoms, ideal, initial, calc) in enumerate(zip(relaxed, perfect, start, calcs)):
        assert (atoms.numbers == ideal.numbers).all() and np.allclose(atoms.cell, ideal.cell)
        forces, fmax = reference_forces(atoms, calc())
        assert fmax < FMAX, k  # converged by the reference's forces, not only by its own
        # the file keeps positions to 1e-8 Å, so reference forces there differ by ~1e-9 eV/Å; the table prints 4 digits
        assert atoms.info["fmax"] == pytest.approx(fmax, abs=1e-7) and float(rows[k][4]) == pytest.approx(fmax, rel=1e-3)
        np.testing.assert_allclose(atoms.get_forces(), forces, atol=1e-7)  # extxyz keeps 8 decimals
        e_out = atoms.get_potential_energy()
        assert float(rows[k][5]) == pytest.approx(e_out, abs=1e-8)
        ideal.calc = calc()
        e_min, lam = ideal.get_potential_energy(), smallest_curvature(ideal, calc())
        bound = 2 * (forces**2).sum() / (2 * lam)
        assert -1e-9 < e_out - e_min < bound, (k, e_out - e_min, bound)
        shift = atoms.positions - ideal.positions
        assert np.linalg.norm(shift - shift.mean(axis=0)) < 2 * np.linalg.norm(forces) / lam, k
        # ASE's FIRE with ASE's calculator from the same start, to the same fmax: the same minimum, within its own bound
        ref = initial.copy()
        ref.calc = calc()
        assert FIRE(ref, logfile=None).run(fmax=FMAX, steps=500)
        ref_forces = ref.get_forces()
        assert abs(ref.get_potential_energy() - e_out) < bound + 2 * (ref_forces**2).sum() / (2 * lam), k


def fcc_lattice_constant(pressure_gpa: float) -> float:
    """fcc argon's lattice constant where ASE's (hydrostatic) stress is minus the pressure, without an optimiser."""
    from ase import units

    def excess(a: float) -> float:
        atoms = argon(1, a)
        atoms.calc = ase_lj()
        return atoms.get_stress()[0] + pressure_gpa * units.GPa

    return brentq(excess, 4.8, 6.0, xtol=1e-10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pressure", [0.0, 0.2])
def test_cell_relaxes_a_strained_crystal_to_its_lattice(tmp_path, capsys, pressure):
    from ase import units

    strain = np.array([[1.04, 0.02, 0.0], [0.0, 0.97, 0.01], [0.0, 0.0, 1.02]])
    start = rattled(argon(2), seed=5, scale=0.03)
    start.set_cell(start.cell.array @ strain, scale_atoms=True)
    structures = write_frames(tmp_path / "strained.extxyz", [start])
    out = tmp_path / "relaxed.extxyz"
    argv = ["relax", str(structures), "-o", str(out), "--config", str(write_potential(tmp_path / "lj.yaml", ("Ar",))), "--cell"]
    argv += ["--fmax", str(FMAX), "--pressure", str(pressure)]
    assert main(argv) == 0
    assert table(capsys.readouterr().out)[0][2] == "yes"
    (atoms,) = read_frames(out)
    n, volume = len(atoms), atoms.get_volume()
    np.testing.assert_allclose(atoms.get_stress(), ase_lj_stress(atoms), atol=1e-9)  # the stress written is the potential's

    # The filter's cell rows are the virial (minus the pressure's) over N: below fmax, the stress is within fmax N / V of -p
    excess = ase_lj_stress(atoms) + pressure * units.GPa * np.array([1, 1, 1, 0, 0, 0])
    assert np.abs(excess).max() < FMAX * n / volume
    # the lattice: cube edges 2 a(p) and right angles, within the strain the residual stress allows (the stiffness
    # below is the smallest second derivative of the enthalpy per volume over the six strains, by finite differences)
    a_p = fcc_lattice_constant(pressure)
    tolerance = 2 * FMAX * n / volume / elastic_floor(a_p, pressure)
    assert_cubic(atoms.cell, 2 * a_p, tolerance)

    # ASE's FIRE with FrechetCellFilter and ASE's calculator, to the same fmax, lands on the same lattice
    ref = start.copy()
    ref.calc = ase_lj()
    assert FIRE(FrechetCellFilter(ref, scalar_pressure=pressure * units.GPa), logfile=None).run(fmax=FMAX, steps=500)
    assert_cubic(ref.cell, 2 * a_p, tolerance)


def assert_cubic(cell, edge: float, strain: float) -> None:
    """Edges ``edge`` and right angles, within ``strain`` (a shear strain tilts an angle by twice its value)."""
    lengths_angles = cell.cellpar()
    np.testing.assert_allclose(lengths_angles[:3] / edge, 1.0, rtol=0, atol=strain)
    np.testing.assert_allclose(np.radians(lengths_angles[3:]), np.pi / 2, rtol=0, atol=2 * strain)


def ase_lj_stress(atoms: Atoms) -> np.ndarray:
    atoms = atoms.copy()
    atoms.calc = ase_lj()
    return atoms.get_stress()


def elastic_floor(a: float, pressure_gpa: float, h: float = 1e-3) -> float:
    """The smallest eigenvalue of d2(E + pV)/(V de de) over the six symmetric strains of perfect fcc at ``a``, eV/Å³."""
    from ase import units

    def enthalpy(eps6: np.ndarray) -> float:
        e = np.array([[eps6[0], eps6[5] / 2, eps6[4] / 2], [eps6[5] / 2, eps6[1], eps6[3] / 2], [eps6[4] / 2, eps6[3] / 2, eps6[2]]])
        atoms = argon(1, a)
        atoms.set_cell(atoms.cell.array @ (np.eye(3) + e), scale_atoms=True)
        atoms.calc = ase_lj()
        return atoms.get_potential_energy() + pressure_gpa * units.GPa * atoms.get_volume()

    basis = np.eye(6) * h
    c = np.array([[enthalpy(bi + bj) - enthalpy(bi - bj) - enthalpy(bj - bi) + enthalpy(-bi - bj) for bj in basis] for bi in basis])
    c /= 4 * h * h * argon(1, a).get_volume()
    return float(np.linalg.eigvalsh(0.5 * (c + c.T)).min())


@pytest.mark.timeout(60)
def test_bad_frames_are_named_and_skipped(tmp_path, capsys):
    good = [rattled(argon(2), 1), rattled(argon((2, 2, 3)), 2)]
    overlapping = argon(2)
    overlapping.positions[7] = overlapping.positions[3] + [0.1, 0.0, 0.0]
    neon = argon(2)
    neon.symbols[0] = "Ne"
    frames = [good[0], Atoms(cell=good[0].cell, pbc=True), overlapping, neon, good[1]]
    structures = write_frames(tmp_path / "mixed.extxyz", frames)
    potential = write_potential(tmp_path / "lj.yaml")
    out = tmp_path / "relaxed.extxyz"
    assert main(["relax", str(structures), "-o", str(out), "--config", str(potential), "--fmax", "0.01"]) == 1
    captured = capsys.readouterr()
    assert "error: frame 1 has no atoms" in captured.err
    assert "error: frame 2: System: atom 3 (Ar) and atom 7 (Ar) are 0.1 Å apart, closer than min_distance=0.5 Å" in captured.err
    assert f"error: frame 3: models.lj in {potential}: no epsilon/sigma for Ne" in captured.err
    assert "frame(s) 1, 2, 3 failed" in captured.err
    rows = table(captured.out)
    assert [r[2] for r in rows] == ["yes", "failed", "failed", "failed", "yes"]
    relaxed = read_frames(out)
    assert [a.info["frame"] for a in relaxed] == [0, 4]
    for atoms in relaxed:
        assert reference_forces(atoms, ase_lj())[1] < 0.01

    # --stop-on-error: the first bad frame ends the run; the frame before it is already written
    assert main(["relax", str(structures), "-o", str(out), "--config", str(potential), "--stop-on-error"]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().endswith("halopipe relax: error: frame 1 has no atoms; remove it from the file")
    assert [r[2] for r in table(captured.out)] == ["yes", "failed"]
    assert [a.info["frame"] for a in read_frames(out)] == [0]


@pytest.mark.timeout(60)
def test_step_limit_leaves_a_frame_unconverged_but_written(tmp_path, capsys):
    structures = write_frames(tmp_path / "one.extxyz", [rattled(argon(2), 3)])
    out = tmp_path / "relaxed.extxyz"
    assert main(["relax", str(structures), "-o", str(out), "--config", str(write_potential(tmp_path / "lj.yaml")), "--steps", "3"]) == 0
    captured = capsys.readouterr()
    assert table(captured.out)[0][2:4] == ["no", "3"]
    assert "frame(s) 0 did not reach fmax 0.05 eV/Å in 3 steps; raise --steps" in captured.err
    (atoms,) = read_frames(out)
    assert not atoms.info["converged"] and atoms.info["relax_steps"] == 3
    assert atoms.info["fmax"] == pytest.approx(reference_forces(atoms, ase_lj())[1], abs=1e-7) and atoms.info["fmax"] > 0.05
