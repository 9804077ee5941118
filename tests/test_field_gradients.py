"""Energy gradients with respect to per-atom fields (``field_gradients``), against central finite differences."""

import numpy as np
import pytest
import torch

from halopipe import ChargeModel, DomainConfig, DSFCoulomb, Ewald, Group, LennardJones, Model, Pipeline, Step

from .conftest import triclinic_nacl

ATOMS = [0, 7, 33, 50]
H = 1e-3  # the energies are polynomials of degree <= 2 in the charges, so the central difference is exact up to rounding


def salt():
    """54 rattled Na/Cl atoms in a triclinic cell with formal charges."""
    return triclinic_nacl(repeat=(3, 3, 3), seed=2)


def central_difference(pipeline, system, name: str, atoms, h: float = H) -> np.ndarray:
    """dE/dx_i of the field ``name`` by central differences, the field fed to ``pipeline`` as a fixed input."""
    values = []
    for i in atoms:
        energies = []
        for sign in (1.0, -1.0):
            x = system.fields[name].clone()
            x[i] += sign * h
            energies.append(float(pipeline(system.replace(fields={**system.fields, name: x}))["energy"]))
        values.append((energies[0] - energies[1]) / (2 * h))
    return np.array(values)


@pytest.mark.parametrize(
    "model",
    [lambda: DSFCoulomb(7.0, 0.2), lambda: Ewald(cutoff=6.0, accuracy=1e-8)],
    ids=["dsf_direct_group", "ewald_autograd_group"],
)
def test_fixed_charges(model):
    system = salt()
    pipe = Pipeline([model()], config=DomainConfig(skin=0.0))
    plain = pipe(system)
    out = pipe(system, field_gradients=["charges"])
    grad = out["d_energy_d_charges"]
    assert grad.shape == system.fields["charges"].shape
    np.testing.assert_allclose(grad[ATOMS].numpy(), central_difference(pipe, system, "charges", ATOMS), rtol=1e-8, atol=1e-8)
    # The rest of the result does not change (DSF's direct group ran by autograd for this call: equal to rounding).
    assert float(out["energy"]) == pytest.approx(float(plain["energy"]), rel=1e-13)
    np.testing.assert_allclose(out["forces"].numpy(), plain["forces"].numpy(), atol=1e-11)
    assert "d_energy_d_charges" not in plain


def test_a_field_read_by_several_groups_sums_their_gradients():
    """Charges read by a direct group (DSF) and an autograd group (Ewald); a field nobody reads gets zeros."""
    system = salt()
    system = system.replace(fields={**system.fields, "spin": torch.linspace(-1, 1, system.n_atoms)})
    pipe = Pipeline(
        [Group([Step(LennardJones(0.01, 3.0, 6.0)), Step(DSFCoulomb(7.0, 0.2))], autograd=False), Ewald(cutoff=6.0, accuracy=1e-8)],
        config=DomainConfig(skin=0.0),
    )
    out = pipe(system, field_gradients=["charges", "spin"])
    np.testing.assert_allclose(out["d_energy_d_charges"][ATOMS].numpy(), central_difference(pipe, system, "charges", ATOMS), atol=1e-8)
    assert torch.equal(out["d_energy_d_spin"], torch.zeros(system.n_atoms))
    # Each group's share is its own model's gradient.
    parts = [
        Pipeline([m], config=DomainConfig(skin=0.0))(system, field_gradients="charges") for m in (DSFCoulomb(7.0, 0.2), pipe.models[2])
    ]
    np.testing.assert_allclose(out["d_energy_d_charges"].numpy(), sum(p["d_energy_d_charges"] for p in parts).numpy(), atol=1e-12)


@pytest.mark.parametrize(
    "consumer",
    [lambda: DSFCoulomb(7.0, 0.2), lambda: Ewald(cutoff=6.0, accuracy=1e-8)],
    ids=["dsf", "ewald"],
)
def test_wired_charges_are_the_downstream_partial(consumer):
    """ChargeModel -> consumer: dE/dq equals the consumer's energy differenced in q held fixed at ChargeModel's output.

    The charge model's own self-energy (hardness) is upstream of the wiring point and does not count.
    """
    system = salt()
    hardness = 2.0
    wired = Pipeline(
        [
            Group(
                [
                    Step(ChargeModel(3.5, coordination_weight=0.05, hardness=hardness), wire={"charges": "q"}),
                    Step(consumer(), bind={"charges": "q"}),
                ]
            )
        ],
        config=DomainConfig(skin=0.0),
    )
    out = wired(system, field_gradients=["q"])
    q = out["fields"]["q"]
    fixed = system.replace(fields={"charges": q})
    downstream = Pipeline([consumer()], config=DomainConfig(skin=0.0))
    fd = central_difference(downstream, fixed, "charges", ATOMS)
    np.testing.assert_allclose(out["d_energy_d_q"][ATOMS].numpy(), fd, rtol=1e-8, atol=1e-8)
    # The producer's self-energy derivative J q_i would be a visible difference had it been included.
    assert float((hardness * q[ATOMS]).abs().min()) > 1e-3
    # The forces still carry the chain term through q: unchanged by the request.
    np.testing.assert_allclose(out["forces"].numpy(), wired(system)["forces"].numpy(), atol=1e-12)


def test_wired_default_name_with_the_system_charges_unread():
    """ChargeModel -> DSF under the default name 'charges', the system's formal charges carried but read by no step."""
    system = salt()
    pipe = Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(DSFCoulomb(7.0, 0.2))])], config=DomainConfig(skin=0.0))
    out = pipe(system, field_gradients="charges")
    fixed = system.replace(fields={"charges": out["fields"]["charges"]})
    fd = central_difference(Pipeline([DSFCoulomb(7.0, 0.2)], config=DomainConfig(skin=0.0)), fixed, "charges", ATOMS)
    np.testing.assert_allclose(out["d_energy_d_charges"][ATOMS].numpy(), fd, atol=1e-8)


class _MustNotRun(Model):
    """A model whose evaluation fails the test: errors must come before any work."""

    inputs = frozenset({"charges"})
    cutoff = 3.0

    def forward(self, view, direct=False):  # pragma: no cover - the check comes first
        raise AssertionError("evaluated despite bad field_gradients")


def test_bad_names_are_rejected_before_any_work():
    system = salt()
    pipe = Pipeline([Group([Step(ChargeModel(3.5), wire={"charges": "q"}), Step(_MustNotRun())])])
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['cherges'\]; available fields .*: \['charges', 'q'\]"):
        pipe(system, field_gradients=["q", "cherges"])
    numbered = system.replace(fields={**system.fields, "label": torch.arange(system.n_atoms)})
    with pytest.raises(ValueError, match="field 'label' has dtype torch.int64, not a floating-point type"):
        pipe(numbered, field_gradients=["label"])
    # 'charges' read from the system by one step and produced by another: two variables under one name.
    both = Pipeline([Group([Step(_MustNotRun()), Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))])])
    with pytest.raises(ValueError, match=r"'charges' is both read from the system \(by \['_MustNotRun'\]\) and produced by ChargeModel"):
        both(system, field_gradients=["charges"])


def test_ase_calculator_property():
    """``Calculator(field_gradients=...)``'s property against ASE energies with one atom's initial charge moved."""
    from halopipe.ase import Calculator

    atoms = salt().to_ase()
    atoms.calc = Calculator(Pipeline([DSFCoulomb(7.0, 0.2)], config=DomainConfig(skin=0.0)), field_gradients=["charges"])
    grad = atoms.calc.get_property("d_energy_d_charges", atoms)
    q = atoms.get_initial_charges()
    fd = []
    for i in ATOMS:
        energies = []
        for sign in (1.0, -1.0):
            moved = q.copy()
            moved[i] += sign * H
            atoms.set_initial_charges(moved)
            energies.append(atoms.get_potential_energy())
        fd.append((energies[0] - energies[1]) / (2 * H))
    atoms.set_initial_charges(q)
    np.testing.assert_allclose(grad[ATOMS], fd, rtol=1e-8, atol=1e-8)
