"""A batch of systems in one call equals one call per system, for every group kind; and its edge cases.

The reference of each check is the same pipeline evaluating each system alone
(a fresh pipeline, so nothing is shared with the batch's plans and lists).
"""

import numpy as np
import pytest
import torch
from ase.build import bulk, fcc111, molecule

from halopipe import (
    DFTD3,
    Batch,
    ChargeModel,
    DomainConfig,
    DSFCoulomb,
    Ewald,
    Group,
    LennardJones,
    Pipeline,
    Step,
    System,
)

from .conftest import cluster, triclinic_nacl

FORCE_TOL = 1e-10
REL_TOL = 1e-12


def with_charges(system: System) -> System:
    q = torch.where(system.numbers == system.numbers[:1], 1.0, -1.0).to(system.dtype)
    return system.replace(fields={"charges": q - q.mean() if system.n_atoms else q})


def mixed() -> list[System]:
    """A triclinic crystal, a molecule, a slab, a second crystal of another size, one atom and no atom."""
    slab = fcc111("Cu", size=(2, 2, 3), vacuum=6.0)
    slab.numbers[::2] = 29
    slab.numbers[1::2] = 13
    slab.rattle(0.05, seed=3)
    water = molecule("CH3CH2OH")
    water.center(vacuum=5.0)
    si = bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 1, 1))
    si.rattle(0.05, seed=4)
    lone = System(positions=torch.zeros(1, 3), numbers=torch.tensor([8]))
    empty = System(positions=torch.zeros(0, 3), numbers=torch.zeros(0, dtype=torch.int64), cell=torch.eye(3) * 8, pbc=True)
    systems = [triclinic_nacl(seed=1), System.from_ase(water), System.from_ase(slab), System.from_ase(si), lone, empty]
    return [with_charges(s) for s in systems]


def lj() -> LennardJones:
    return LennardJones(epsilon=0.01, sigma=2.6, cutoff=6.0)


def demo_like() -> list:
    """The demo's composite: charges wired into DSF Coulomb (autograd), plus LJ (direct)."""
    wired = Group([Step(ChargeModel(cutoff=4.0, coordination_weight=0.02)), Step(DSFCoulomb(cutoff=8.0, alpha=0.2))])
    return [lj(), wired]


PIPELINES = {
    "direct": lambda: [Group([Step(lj()), Step(DSFCoulomb(cutoff=7.0, alpha=0.2))], autograd=False)],
    "autograd": lambda: [Group([Step(lj()), Step(DSFCoulomb(cutoff=7.0, alpha=0.2))], autograd=True)],
    "wired": demo_like,
    "d3_lattice": lambda: [lj(), DFTD3("pbe", cutoff=20.0, cn_cutoff=15.0)],
}


def assert_matches_alone(groups, systems, stress: bool, field_gradients=None):
    """``Pipeline(groups)(systems)`` against a fresh pipeline per system, split back per system."""
    batch_out = Pipeline(groups(), config=DomainConfig(skin=0.3))(systems, stress=stress, field_gradients=field_gradients)
    n = sum(s.n_atoms for s in systems)
    assert batch_out["energy"].shape == (len(systems),)
    assert batch_out["forces"].shape == (n, 3)
    if stress:
        assert batch_out["stress"].shape == (len(systems), 3, 3)
    for b, (system, one) in enumerate(zip(systems, Batch(systems).split(batch_out))):
        alone = Pipeline(groups(), config=DomainConfig(skin=0.3))(system, stress=stress, field_gradients=field_gradients)
        scale = max(1.0, abs(float(alone["energy"])))
        assert abs(float(one["energy"]) - float(alone["energy"])) <= REL_TOL * scale, f"system {b}"
        for name, e in alone["model_energies"].items():
            assert abs(float(one["model_energies"][name]) - float(e)) <= REL_TOL * max(1.0, abs(float(e))), f"system {b}, {name}"
        np.testing.assert_allclose(one["forces"].numpy(), alone["forces"].numpy(), rtol=0, atol=FORCE_TOL, err_msg=f"system {b}")
        np.testing.assert_allclose(one["energies"].numpy(), alone["energies"].numpy(), rtol=0, atol=1e-12, err_msg=f"system {b}")
        for name, value in alone["fields"].items():
            np.testing.assert_allclose(one["fields"][name].numpy(), value.numpy(), rtol=0, atol=1e-12, err_msg=f"system {b}, {name}")
        for key in [k for k in alone if k.startswith("d_energy_d_")]:
            np.testing.assert_allclose(one[key].numpy(), alone[key].numpy(), rtol=0, atol=1e-11, err_msg=f"system {b}, {key}")
        if stress and system.n_atoms and bool(system.pbc.all()):
            np.testing.assert_allclose(one["stress"].numpy(), alone["stress"].numpy(), rtol=0, atol=REL_TOL * scale, err_msg=f"system {b}")
    return batch_out


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_mixed_batch_equals_one_call_per_system(kind):
    systems = mixed()
    if kind == "d3_lattice":
        systems = [s for s in systems if s.n_atoms != 1]  # D3 has no C6 for a lone O atom's neighbours: nothing new
    assert_matches_alone(PIPELINES[kind], systems, stress=False)


@pytest.mark.parametrize("kind", ["direct", "wired", "d3_lattice"])
def test_stress_per_system(kind):
    """Periodic systems of different cells: one strain per system, stress (B, 3, 3)."""
    systems = [s for s in mixed() if bool(s.pbc.all()) and s.n_atoms > 0]
    out = assert_matches_alone(PIPELINES[kind], systems, stress=True)
    assert out["virial"].shape == (len(systems), 3, 3)


def test_ewald_and_field_gradients_per_system():
    """Ewald (one view per system: reciprocal sums never cross systems), charges wired, dE/dq per system."""
    systems = [triclinic_nacl(seed=s, repeat=r) for s, r in ((1, (2, 2, 2)), (2, (2, 3, 2)))]

    def groups():
        return [Group([Step(ChargeModel(cutoff=4.0)), Step(Ewald(cutoff=6.0, accuracy=1e-8))]), lj()]

    assert_matches_alone(groups, systems, stress=True, field_gradients=["charges"])


def test_fixed_charge_gradients_per_system():
    systems = [s for s in mixed() if s.n_atoms > 1]
    assert_matches_alone(PIPELINES["direct"], systems, stress=False, field_gradients=["charges"])


def test_repeated_calls_reuse_plans_and_follow_moving_atoms():
    """A second call on moved atoms (a relaxation step) gives the numbers of a fresh evaluation."""
    systems = [s for s in mixed() if s.n_atoms > 1]
    pipe = Pipeline(demo_like(), config=DomainConfig(skin=0.3))
    pipe(systems)
    moved = [s.replace(positions=s.positions + 0.05 * torch.sin(torch.arange(s.n_atoms * 3.0)).reshape(-1, 3)) for s in systems]
    again = pipe(moved)
    fresh = Pipeline(demo_like(), config=DomainConfig(skin=0.3))(moved)
    # The kept lists hold the pairs in another order than fresh ones: sums differ by rounding, 4e-12 on forces of 1e4
    # eV/Å between the close atoms of `mixed()` (3e-16 relative). The brief's bound on forces holds.
    np.testing.assert_allclose(again["forces"].numpy(), fresh["forces"].numpy(), rtol=0, atol=1e-10)
    np.testing.assert_allclose(again["energy"].numpy(), fresh["energy"].numpy(), rtol=1e-14)


def test_ase_structures_of_different_sizes_as_a_new_user_would():
    atoms = [bulk("Cu", "fcc", a=3.6).repeat(k) for k in (2, 3)] + [molecule("H2O")]
    atoms[2].center(vacuum=4.0)
    systems = [System.from_ase(a) for a in atoms]
    pipe = Pipeline([lj()])
    out = pipe(systems, stress=False)
    for system, one in zip(systems, Batch(systems).split(out)):
        alone = pipe(system)
        assert float(one["energy"]) == pytest.approx(float(alone["energy"]), rel=REL_TOL)
        np.testing.assert_allclose(one["forces"].numpy(), alone["forces"].numpy(), rtol=0, atol=FORCE_TOL)


def test_empty_system_alone_and_in_a_batch():
    empty = mixed()[-1]
    out = Pipeline(demo_like())(empty)
    assert float(out["energy"]) == 0.0 and out["forces"].shape == (0, 3)
    out = Pipeline(demo_like())([empty, empty])
    assert out["energy"].tolist() == [0.0, 0.0] and out["forces"].shape == (0, 3)


def test_species_a_model_lacks_names_the_system():
    pair = System(positions=torch.tensor([[0.0, 0, 0], [3.0, 0, 0]]), numbers=torch.tensor([11, 118]), fields={"charges": torch.zeros(2)})
    systems = [triclinic_nacl(seed=1), pair]
    with pytest.raises(ValueError, match=r"system 1 of the batch: LennardJones.*118"):
        Pipeline([LennardJones(epsilon={11: 0.01, 17: 0.01}, sigma={11: 2.5, 17: 3.0}, cutoff=6.0)])(systems)
    with pytest.raises(ValueError, match=r"system 1 of the batch: ChargeModel.*118"):
        Pipeline(demo_like())(systems)


def test_bad_batches_are_refused_with_the_system_named():
    a = triclinic_nacl(seed=1)
    with pytest.raises(ValueError, match=r"system 1 is torch.float32 on cpu but system 0 is torch.float64"):
        Pipeline([lj()])([a, a.to(dtype=torch.float32)])
    with pytest.raises(ValueError, match=r"system 1 carries fields \{\}"):
        Pipeline([lj()])([a, a.replace(fields={})])
    with pytest.raises(ValueError, match="at least one system"):
        Pipeline([lj()])([])
    with pytest.raises(ValueError, match="item 1 is a str"):
        Pipeline([lj()])([a, "water"])
    squeezed = cluster(4).replace(positions=torch.zeros(4, 3))
    with pytest.raises(ValueError, match="system 1 of the batch: .*closer"):
        Pipeline([lj()])([a, squeezed.replace(fields={"charges": torch.zeros(4)})])


def test_pipeline_on_another_device_names_both():
    system = triclinic_nacl(seed=1)
    with pytest.raises(ValueError, match=r"LennardJones holds tensors on meta but the system is on cpu"):
        Pipeline([lj()]).to("meta")(system)
    with pytest.raises(ValueError, match=r"holds tensors on meta but the system is on cpu"):
        Pipeline([lj()]).to("meta")([system, system])
