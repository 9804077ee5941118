import numpy as np
import pytest
import torch
from ase.build import bulk, molecule

from halopipe import System


def test_ase_round_trip_keeps_fields():
    atoms = bulk("NaCl", "rocksalt", a=5.64).repeat(2)
    atoms.set_initial_charges(np.linspace(-1, 1, len(atoms)))
    atoms.set_velocities(np.random.default_rng(0).normal(size=(len(atoms), 3)) * 0.01)
    s = System.from_ase(atoms)
    assert s.dtype == torch.float64 and s.fields["charges"].shape == (len(atoms),)
    back = s.to_ase()
    np.testing.assert_allclose(back.positions, atoms.positions, atol=0)
    np.testing.assert_allclose(back.cell.array, atoms.cell.array, atol=0)
    np.testing.assert_array_equal(back.pbc, atoms.pbc)
    np.testing.assert_allclose(back.get_initial_charges(), atoms.get_initial_charges())
    np.testing.assert_allclose(back.get_velocities(), atoms.get_velocities(), rtol=1e-12)
    np.testing.assert_allclose(back.get_masses(), atoms.get_masses())


def test_velocity_units_are_angstrom_per_fs():
    from ase import units

    atoms = molecule("H2O")
    atoms.set_velocities(np.ones((3, 3)))  # Å per ASE time unit
    s = System.from_ase(atoms)
    np.testing.assert_allclose(s.fields["velocities"].numpy(), np.ones((3, 3)) * units.fs)


def test_float32_supported():
    s = System.from_ase(molecule("CH4"), dtype=torch.float32)
    assert s.positions.dtype == torch.float32 and s.masses.dtype == torch.float32


def test_default_masses_are_standard():
    s = System(positions=torch.zeros(2, 3) + torch.tensor([[0.0], [1.0]]), numbers=[1, 8])
    np.testing.assert_allclose(s.masses.numpy(), [1.008, 15.999], atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"positions": [[0, 0, float("nan")]], "numbers": [1]}, "atom 0 has a non-finite position"),
        ({"positions": [[0, 0, 0]], "numbers": [0]}, "atomic number 0, outside 1..118"),
        ({"positions": [[0, 0, 0]], "numbers": [119]}, "atomic number 119"),
        ({"positions": [[0, 0, 0], [1, 0, 0]], "numbers": [1]}, "numbers must have shape"),
        ({"positions": [[0, 0]], "numbers": [1]}, "positions must have shape"),
        (
            {"positions": [[0, 0, 0]], "numbers": [1], "pbc": [True, True, True], "cell": [[1, 0, 0], [2, 0, 0], [0, 0, 1]]},
            "linearly dependent",
        ),
        ({"positions": [[0, 0, 0]], "numbers": [1], "pbc": [True, False, False]}, "axis 0 is periodic but its lattice vector is zero"),
        ({"positions": [[0, 0, 0]], "numbers": [1], "fields": {"charges": [1.0, 2.0]}}, "field 'charges' has shape"),
        ({"positions": [[0, 0, 0]], "numbers": [1], "masses": [-1.0]}, "atom 0 has mass -1.0"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        System(**kwargs)


def test_non_periodic_axis_may_have_zero_vector():
    s = System(positions=[[0, 0, 0], [1, 1, 1]], numbers=[1, 1], cell=[[5, 0, 0], [0, 5, 0], [0, 0, 0]], pbc=[True, True, False])
    assert s.pbc.tolist() == [True, True, False]
