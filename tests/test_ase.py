"""The ASE calculator against ASE's own conventions and calculators.

References: ASE's Lennard-Jones calculator (energy, per-atom energies, forces,
stress, and which properties it refuses), ASE's numerical derivatives
(``ase.calculators.fd``) and ASE's property registry (``ase.outputs``, through
``export_properties``, which checks every property's shape and type).
"""

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.fd import calculate_numerical_forces, calculate_numerical_stress
from ase.calculators.lj import LennardJones as AseLJ

from halopipe import ChargeModel, DomainConfig, DSFCoulomb, Group, LennardJones, Pipeline, Step
from halopipe.ase import Calculator

EPS, SIGMA, RC = 0.0103, 3.4, 7.0


def argon(seed: int = 3) -> Atoms:
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=seed)
    return atoms


def pair(atoms: Atoms) -> tuple[Atoms, Atoms]:
    """The same atoms under ASE's Lennard-Jones and under halopipe's."""
    ref = atoms.copy()
    ref.calc = AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC)
    atoms.calc = Calculator(LennardJones(EPS, SIGMA, RC))
    return atoms, ref


def assert_same(atoms: Atoms, ref: Atoms, stress: bool = True) -> None:
    assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(atoms.get_potential_energies(), ref.get_potential_energies(), atol=1e-13)
    np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), atol=1e-12)
    if stress:
        np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), atol=1e-13)


def test_matches_ase_lennard_jones_per_atom_energies_included():
    atoms, ref = pair(argon())
    assert_same(atoms, ref)
    assert atoms.get_potential_energies().shape == (len(atoms),)


def test_properties_pass_ase_output_registry():
    atoms, _ = pair(argon())
    atoms.get_stress()
    atoms.get_forces()
    exported = atoms.calc.export_properties()  # ase.outputs.Properties checks each shape against natoms
    assert {"energy", "free_energy", "energies", "forces", "stress"} <= set(exported)
    assert exported["natoms"] == len(atoms)


def test_forces_and_stress_equal_ase_numerical_derivatives():
    atoms, _ = pair(argon())
    np.testing.assert_allclose(atoms.get_forces(), calculate_numerical_forces(atoms, eps=1e-5), atol=1e-8)
    np.testing.assert_allclose(atoms.get_stress(), calculate_numerical_stress(atoms, eps=1e-5), atol=1e-9)


def test_stress_of_an_autograd_group_equals_ase_lennard_jones():
    """Stress through the strain derivative (an autograd group): ASE's periodicity test gives a numpy bool, which must not reach torch."""
    atoms, ref = pair(argon())
    atoms.calc = Calculator(Pipeline([Group([Step(LennardJones(EPS, SIGMA, RC))], autograd=True)]))
    np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), atol=1e-13)


def test_calc_survives_changes_of_atom_count_and_cell():
    atoms, ref = pair(argon())
    assert_same(atoms, ref)
    changes = (
        lambda a: a.pop(5),
        lambda a: a.set_cell(a.cell * 1.03, scale_atoms=True),
        lambda a: a.extend(Atoms("Ar", [[1.0, 1.2, 0.9]])),
    )
    for change in changes:
        change(atoms)
        change(ref)
        assert_same(atoms, ref)


def test_unavailable_properties_are_refused_as_ase_lennard_jones_refuses_them():
    molecule = Atoms("Ar3", positions=[[0, 0, 0], [3.7, 0, 0], [0, 3.9, 0.4]])
    atoms, ref = pair(molecule)
    assert_same(atoms, ref, stress=False)
    for name in ("stress", "charges", "magmoms"):
        with pytest.raises(PropertyNotImplementedError):
            ref.calc.get_property(name, ref)
        with pytest.raises(PropertyNotImplementedError):
            atoms.calc.get_property(name, atoms)


def test_model_energies_is_an_extra_property_per_step():
    atoms = argon()
    weak, strong = LennardJones(0.002, 3.0, 6.0), LennardJones(EPS, SIGMA, RC)
    atoms.calc = Calculator(Pipeline([Step(weak, name="weak"), Step(strong, name="strong")]))
    parts = atoms.calc.get_property("model_energies", atoms)
    for name, (sigma, eps, rc) in {"weak": (3.0, 0.002, 6.0), "strong": (SIGMA, EPS, RC)}.items():
        ref = atoms.copy()
        ref.calc = AseLJ(sigma=sigma, epsilon=eps, rc=rc)
        assert parts[name] == pytest.approx(ref.get_potential_energy(), rel=1e-12)
    assert "model_energies" not in atoms.calc.export_properties()


def test_charges_of_a_charge_model_through_get_charges():
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2)
    atoms.rattle(0.1, seed=1)
    charge_model = ChargeModel(3.5, coordination_weight=0.05)
    atoms.calc = Calculator(Pipeline([Group([Step(charge_model), Step(DSFCoulomb(7.0, 0.2))])], config=DomainConfig(skin=0.0)))
    charges = atoms.get_charges()
    assert charges.shape == (len(atoms),)
    assert abs(charges.sum()) < 1e-12  # ChargeModel conserves the (zero) net charge
    assert (charges[atoms.numbers == 11] > 0).all() and (charges[atoms.numbers == 17] < 0).all()
    np.testing.assert_allclose(atoms.get_initial_charges(), 0.0)  # the calculator does not touch the input
    alone = atoms.copy()
    alone.calc = Calculator(Pipeline([Group([Step(charge_model)], autograd=True)]))
    np.testing.assert_allclose(charges, alone.get_charges(), atol=1e-14)  # the same model without the consumer
