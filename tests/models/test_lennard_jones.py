import itertools

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLJ

from halopipe import Group, LennardJones, Pipeline, System
from halopipe.testing import check_model

from ..conftest import cluster


def _argon(seed=1):
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.1, seed=seed)
    atoms.set_cell(atoms.cell.array + np.array([[0, 0.3, 0.2], [0.5, 0, 0], [0.1, 0.7, 0]]), scale_atoms=True)
    return atoms


@pytest.mark.parametrize("autograd", [True, False])
@pytest.mark.parametrize("cutoff", [5.0, 7.0, 12.0])  # the last is longer than the cell: many images
def test_matches_ase_on_periodic_triclinic(autograd, cutoff):
    atoms = _argon()
    atoms.calc = AseLJ(sigma=3.4, epsilon=0.0103, rc=cutoff)
    out = Pipeline([Group([LennardJones(0.0103, 3.4, cutoff)], autograd=autograd)])(System.from_ase(atoms), stress=True)
    assert float(out["energy"]) == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    # Per atom: half of each pair at each end; a pair through a periodic image has its ghost end's half folded home.
    np.testing.assert_allclose(out["energies"].numpy(), atoms.get_potential_energies(), atol=1e-12)
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), atol=1e-12)
    np.testing.assert_allclose(out["stress"].numpy(), atoms.get_stress(voigt=False), atol=1e-13)


@pytest.mark.parametrize("autograd", [True, False])
def test_evaluates_its_one_holder_list_without_a_whole_half_list(autograd):
    """LennardJones reads only its one-holder list: the domain searches that list with the rule, and no half list is made.

    A model reading the view's half list would have the domain search it
    (and the one-holder list filtered from it); the forces match ASE either way.
    """
    atoms = _argon()
    atoms.calc = AseLJ(sigma=3.4, epsilon=0.0103, rc=7.0)
    pipeline = Pipeline([Group([LennardJones(0.0103, 3.4, 7.0)], autograd=autograd)])
    out = pipeline(System.from_ase(atoms))
    assert {kind for _, _, kind in pipeline._domain._pair_lists._lists} == {"one_holder"}
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), atol=1e-12)


def test_matches_ase_on_non_periodic_cluster():
    s = cluster(25, species=(18,), charges=False)
    atoms = s.to_ase()
    atoms.calc = AseLJ(sigma=3.4, epsilon=0.0103, rc=6.0)
    out = Pipeline([LennardJones(0.0103, 3.4, 6.0)])(s)
    assert float(out["energy"]) == pytest.approx(atoms.get_potential_energy(), rel=1e-12)
    np.testing.assert_allclose(out["forces"].numpy(), atoms.get_forces(), atol=1e-12)


def _lj_reference(pos, numbers, cell, eps, sig, rc):
    """Independent brute-force LJ with Lorentz-Berthelot mixing over periodic images."""
    energy = 0.0
    for s in itertools.product(range(-2, 3), repeat=3):
        d = pos[None, :, :] + np.array(s) @ cell - pos[:, None, :]
        r = np.linalg.norm(d, axis=2)
        for i, j in zip(*np.nonzero((r > 0) & (r <= rc))):
            e = np.sqrt(eps[numbers[i]] * eps[numbers[j]])
            sg = 0.5 * (sig[numbers[i]] + sig[numbers[j]])
            energy += 0.5 * 4 * e * ((sg / r[i, j]) ** 12 - (sg / r[i, j]) ** 6 - (sg / rc) ** 12 + (sg / rc) ** 6)
    return energy


def test_species_mixing_matches_independent_reference(nacl):
    eps, sig = {11: 0.0115, 17: 0.0043}, {11: 2.6, 17: 4.0}
    out = Pipeline([LennardJones(eps, sig, 6.0)])(nacl)
    ref = _lj_reference(nacl.positions.numpy(), nacl.numbers.numpy(), nacl.cell.numpy(), eps, sig, 6.0)
    assert float(out["energy"]) == pytest.approx(ref, rel=1e-12)


def test_explicit_pair_parameter_overrides_mixing(nacl):
    base = Pipeline([LennardJones({11: 0.01, 17: 0.01}, {11: 3.0, 17: 3.0}, 6.0)])(nacl)
    same = Pipeline([LennardJones({11: 0.01, 17: 0.01, (11, 17): 0.01}, {11: 3.0, 17: 3.0}, 6.0)])(nacl)
    other = Pipeline([LennardJones({11: 0.01, 17: 0.01, (11, 17): 0.02}, {11: 3.0, 17: 3.0}, 6.0)])(nacl)
    assert float(same["energy"]) == float(base["energy"])
    assert float(other["energy"]) != pytest.approx(float(base["energy"]))


def test_conformance_periodic_and_cluster(nacl):
    check_model(LennardJones({11: 0.0115, 17: 0.0043}, {11: 2.6, 17: 3.6}, 6.0), nacl)
    check_model(LennardJones(0.0103, 3.4, 6.0), cluster(20, species=(18,), charges=False))


def test_missing_species_parameters_are_named(nacl):
    with pytest.raises(ValueError, match=r"no parameters for the species pair \((11|17), (11|17)\)"):
        Pipeline([LennardJones({11: 0.01}, {11: 3.0}, 6.0)])(nacl)


def test_bad_cutoff():
    with pytest.raises(ValueError, match="LennardJones: cutoff must be a finite positive number of Å"):
        LennardJones(0.01, 3.0, -1.0)


def test_float32_agrees_with_float64(nacl):
    model = LennardJones({11: 0.0115, 17: 0.0043}, {11: 2.6, 17: 3.6}, 6.0)
    e64 = Pipeline([model])(nacl)["forces"]
    e32 = Pipeline([model])(nacl.to(torch.float32))["forces"]
    assert e32.dtype == torch.float32
    np.testing.assert_allclose(e32.numpy(), e64.numpy(), atol=1e-4)
