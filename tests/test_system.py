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


def _nacl_with(positions_edit) -> System:
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2)
    positions_edit(atoms.positions, atoms.cell.array)
    return System.from_ase(atoms)


def test_coincident_atoms_are_named_with_symbols_and_distance():
    def duplicate(pos, cell):
        pos[9] = pos[4]

    system = _nacl_with(duplicate)
    numbers = system.numbers.tolist()
    with pytest.raises(ValueError, match=r"atom 4 \((Na|Cl)\) and atom 9 \((Na|Cl)\) are 0 Å apart, closer than min_distance=0.5 Å"):
        system.check_close_contacts()
    assert {numbers[4], numbers[9]} <= {11, 17}


def test_close_contact_across_the_periodic_boundary():
    def across(pos, cell):
        pos[0] = [0.1, 1.0, 1.0]
        pos[1] = [cell[0, 0] - 0.2, 1.0, 1.0]  # 0.3 Å from atom 0 through the x boundary

    system = _nacl_with(across)
    with pytest.raises(ValueError, match=r"atom 0 \(Na\) and atom 1 \(Cl\) are 0.3 Å apart"):
        system.check_close_contacts()
    system.replace(pbc=[False, True, True]).check_close_contacts()  # not periodic along x: 11 Å apart, fine


def test_min_distance_is_overridable_and_validated():
    def near(pos, cell):
        pos[1] = pos[0] + [0.4, 0.0, 0.0]

    system = _nacl_with(near)
    with pytest.raises(ValueError, match="0.4 Å apart"):
        system.check_close_contacts()
    system.replace(min_distance=0.3).check_close_contacts()
    system.replace(min_distance=0.0).check_close_contacts()  # disabled
    with pytest.raises(ValueError, match="min_distance must be a finite number"):
        system.replace(min_distance=float("nan"))


def test_close_contacts_are_found_at_setup_by_pipeline_and_scatter():
    from halopipe import LennardJones, Pipeline
    from halopipe.distributed import ShardedSystem

    def duplicate(pos, cell):
        pos[3] = pos[2]

    system = _nacl_with(duplicate)
    with pytest.raises(ValueError, match=r"atom 2 \(\w+\) and atom 3"):
        Pipeline([LennardJones(cutoff=5.0)])(system)
    with pytest.raises(ValueError, match=r"atom 2 \(\w+\) and atom 3"):
        ShardedSystem.scatter(system)


def test_close_contact_search_scales_linearly():
    """A neighbour search, not all pairs: 62500 atoms have 2e9 pairs, whose distances alone would take 16 GB."""
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(25)  # 62500 atoms, nearest neighbours 2.55 Å
    system = System.from_ase(atoms)
    system.check_close_contacts()


def test_from_ase_with_an_atomic_number_beyond_the_table_names_the_atom():
    """ASE has no mass for Z = 200: the System's own check must speak first, not an IndexError."""
    from ase import Atoms

    with pytest.raises(ValueError, match=r"atom 1 has atomic number 200, outside 1\.\.118"):
        System.from_ase(Atoms(numbers=[6, 200], positions=[[0, 0, 0], [1.5, 0, 0]]))
