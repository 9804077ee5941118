import numpy as np
import pytest
import torch

from halopipe import ChargeModel, DomainConfig, DSFCoulomb, Ewald, Group, LennardJones, Model, ModelOutput, Pipeline, Step
from halopipe.testing import finite_difference_forces, finite_difference_stress

from .conftest import cluster

LJ = dict(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.6, 17: 3.6}, cutoff=6.0)


def wired(stress_system):
    return Pipeline([Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))], autograd=True)])


class DetachedCharges(Model):
    """A ChargeModel whose charges carry no graph: drops the chain term dE/dq * dq/dr."""

    outputs = frozenset({"charges"})

    def __init__(self, inner):
        super().__init__()
        self.inner, self.cutoff = inner, inner.cutoff

    def forward(self, view, direct=False):
        out = self.inner(view)
        return ModelOutput(energies=out.energies, fields={"charges": out.fields["charges"].detach()})


def test_wired_group_forces_and_stress_include_chain_term(nacl):
    pipe = Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(DSFCoulomb(7.0, 0.2))], autograd=True)])
    out = pipe(nacl, stress=True)
    atoms = [0, 5, 11]
    fd = finite_difference_forces(pipe, nacl, atoms)
    np.testing.assert_allclose(out["forces"][atoms].numpy(), fd.numpy(), atol=1e-7)
    np.testing.assert_allclose(out["stress"].numpy(), finite_difference_stress(pipe, nacl).numpy(), atol=1e-8)
    # Without the chain term the same comparison fails clearly.
    broken = Pipeline([Group([Step(DetachedCharges(ChargeModel(3.5, coordination_weight=0.05))), Step(DSFCoulomb(7.0, 0.2))])])
    bad = broken(nacl, stress=True)
    assert float(bad["energy"]) == pytest.approx(float(out["energy"]), rel=1e-14)
    assert float((bad["forces"][atoms] - fd).abs().max()) > 1e-3
    assert float((bad["stress"] - out["stress"]).abs().max()) > 1e-5


def test_wired_non_periodic(molecule_cloud):
    pipe = Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(DSFCoulomb(7.0, 0.2))])])
    out = pipe(molecule_cloud)
    fd = finite_difference_forces(pipe, molecule_cloud, [0, 7])
    np.testing.assert_allclose(out["forces"][[0, 7]].numpy(), fd.numpy(), atol=1e-7)


@pytest.mark.parametrize("direct", [True, False])
def test_composition_equals_sum_of_parts(nacl, direct):
    lj, dsf = LennardJones(**LJ), DSFCoulomb(7.0, 0.2)
    together = Pipeline([Group([Step(lj)], autograd=not direct), Group([Step(dsf)])])(nacl, stress=True)
    parts = [Pipeline([m])(nacl, stress=True) for m in (lj, dsf)]
    assert float(together["energy"]) == pytest.approx(sum(float(p["energy"]) for p in parts), rel=1e-14)
    np.testing.assert_allclose(together["forces"].numpy(), sum(p["forces"] for p in parts).numpy(), atol=1e-13)
    np.testing.assert_allclose(together["stress"].numpy(), sum(p["stress"] for p in parts).numpy(), atol=1e-15)
    assert set(together["model_energies"]) == {"LennardJones", "DSFCoulomb"}
    # Per-atom energies add up to each part's total: an independent split of the same sum.
    assert float(together["energies"].sum()) == pytest.approx(float(together["energy"]), rel=1e-14)


def test_direct_group_sums_models_and_equals_autograd(nacl):
    a, b = LennardJones(**LJ), LennardJones(0.001, 3.0, 5.0)
    direct = Pipeline([Group([a, b], autograd=False)])(nacl, stress=True)
    auto = Pipeline([Group([a, b], autograd=True)])(nacl, stress=True)
    np.testing.assert_allclose(direct["forces"].numpy(), auto["forces"].numpy(), atol=1e-13)
    np.testing.assert_allclose(direct["stress"].numpy(), auto["stress"].numpy(), atol=1e-15)
    assert list(direct["model_energies"]) == ["LennardJones", "LennardJones_2"]


def test_wire_renames_and_bind_selects(nacl):
    pipe = Pipeline([Group([Step(ChargeModel(3.5), wire={"charges": "q_model"}), Step(DSFCoulomb(7.0, 0.2), bind={"charges": "q_model"})])])
    out = pipe(nacl)
    plain = Pipeline([Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))])])(nacl)
    assert float(out["energy"]) == float(plain["energy"])
    assert "q_model" in out["fields"]
    # Without bind, DSFCoulomb reads the system's formal charges instead.
    formal = Pipeline([Group([Step(ChargeModel(3.5), wire={"charges": "q_model"}), Step(DSFCoulomb(7.0, 0.2))])])(nacl)
    assert float(formal["energy"]) == pytest.approx(float(Pipeline([DSFCoulomb(7.0, 0.2)])(nacl)["energy"]), rel=1e-14)


def test_wired_field_into_direct_group_is_rejected():
    with pytest.raises(ValueError, match="consumed by .* in a direct group"):
        Pipeline([Group([Step(ChargeModel())]), Group([Step(_DirectCharged())], autograd=False)])


def test_field_crossing_groups_is_rejected():
    with pytest.raises(ValueError, match="chain term .* would be lost"):
        Pipeline([Group([Step(ChargeModel())]), Group([Step(DSFCoulomb())])])


def test_model_without_direct_forces_cannot_be_in_direct_group():
    with pytest.raises(ValueError, match="does not offer direct forces"):
        Group([Ewald()], autograd=False)


class _OwnedForcesClaimedButAllRows(LennardJones):
    """Declares complete owned forces (no fold) but returns a force for every row of its view."""

    ghost_forces = False

    def forward(self, view, direct=False):
        out = super().forward(view, direct)
        if direct:
            out.forces = torch.cat([out.forces, out.forces.new_zeros(view.n_rows - view.n_owned, 3)])
        return out


def test_direct_forces_of_the_wrong_length_are_named(nacl):
    with pytest.raises(RuntimeError, match=r"_OwnedForcesClaimedButAllRows: direct forces have \d+ rows, expected 16: its owned rows only"):
        Pipeline([Group([_OwnedForcesClaimedButAllRows(0.01, 3.0, 5.0)], autograd=False)])(nacl)


def test_forces_only_leaves_energies_out_and_keeps_the_forces(nacl):
    """``energy=False`` (most MD steps) over a direct group and a wired autograd group: same forces, no energy keys."""
    charges = Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(DSFCoulomb(7.0, 0.2))], autograd=True)
    pipe = Pipeline([Group([Step(LennardJones(**LJ))], autograd=False), charges])
    full, forces_only = pipe(nacl), pipe(nacl, energy=False)
    assert not {"energy", "energies", "model_energies"} & set(forces_only)
    assert torch.equal(forces_only["forces"], full["forces"])
    torch.testing.assert_close(forces_only["fields"]["charges"], full["fields"]["charges"], atol=0, rtol=0)


class _NoEnergiesEver(LennardJones):
    """Leaves its energies out even when its view needs them."""

    def forward(self, view, direct=False):
        out = super().forward(view, direct)
        out.energies = None
        return out


def test_a_direct_model_that_drops_needed_energies_is_named(nacl):
    with pytest.raises(RuntimeError, match="_NoEnergiesEver: a direct evaluation that needs its energies returned none"):
        Pipeline([Group([_NoEnergiesEver(**LJ)], autograd=False)])(nacl)
    assert Pipeline([Group([_NoEnergiesEver(**LJ)], autograd=False)])(nacl, energy=False)["forces"].shape == (nacl.n_atoms, 3)


class _EnergiesOneRowShort(LennardJones):
    """Returns energies for one row fewer than its view has (per-row energies are fine only through autograd)."""

    def forward(self, view, direct=False):
        out = super().forward(view, direct)
        out.energies = view.positions.new_zeros(view.n_rows - 1)
        return out


@pytest.mark.parametrize(
    "autograd, expected", [(True, "its owned rows or all its rows"), (False, "folds its ghost rows' shares home itself")]
)
def test_energies_of_the_wrong_length_are_named(nacl, autograd, expected):
    with pytest.raises(RuntimeError, match=rf"_EnergiesOneRowShort: energies of shape \(\d+,\), expected one per row of .*{expected}"):
        Pipeline([Group([_EnergiesOneRowShort(**LJ)], autograd=autograd)])(nacl)


def test_missing_input_field_is_named():
    s = cluster(10, charges=False)
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['charges'\]"):
        Pipeline([DSFCoulomb()])(s)


def test_stress_needs_a_volume():
    with pytest.raises(ValueError, match="zero volume"):
        Pipeline([LennardJones(0.01, 3.0, 5.0)])(cluster(10, charges=False), stress=True)


def test_skin_reuses_plan_and_stays_exact(nacl):
    skinned = Pipeline([Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))])], config=DomainConfig(skin=1.0))
    fresh = Pipeline([Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))])], config=DomainConfig(skin=0.0))
    g = torch.Generator().manual_seed(0)
    s = nacl
    for _ in range(5):
        s = s.replace(positions=s.positions + 0.04 * torch.randn(s.positions.shape, generator=g, dtype=torch.float64))
        a, b = skinned(s, stress=True), fresh(s, stress=True)
        assert float(a["energy"]) == pytest.approx(float(b["energy"]), rel=1e-13)
        np.testing.assert_allclose(a["forces"].numpy(), b["forces"].numpy(), atol=1e-12)
    assert skinned._domain.plan_version < fresh._domain.plan_version


class _DirectCharged(Model):
    inputs = frozenset({"charges"})
    direct_forces = True
    cutoff = 3.0

    def forward(self, view, direct=False):  # pragma: no cover - construction fails first
        raise AssertionError


def test_group_kind_is_inferred_and_can_be_overridden():
    lj = LennardJones(**LJ)
    assert Group([lj]).autograd is False  # every model offers direct forces, nothing is wired
    assert Group([lj, LennardJones(0.001, 3.0, 5.0)]).autograd is False
    assert Group([ChargeModel(3.5), DSFCoulomb(7.0, 0.2)]).autograd is True  # a field is produced in the group
    assert Group([lj, ChargeModel(3.5)]).autograd is True  # ChargeModel has no direct forces
    assert Group([lj], autograd=True).autograd is True
    assert Pipeline([lj, DSFCoulomb(7.0, 0.2)]).groups[0].autograd is False


@pytest.mark.parametrize(
    "step",
    [
        lambda: Step(ChargeModel(3.5), wire={"charges": "forces"}),
        lambda: Step(DSFCoulomb(7.0, 0.2), bind={"charges": "energy"}),
        lambda: Step(_Produces("stress")),
        lambda: Step(_Produces("energies")),
    ],
)
def test_field_named_like_a_result_key_is_rejected(step):
    with pytest.raises(ValueError, match="reserved result key"):
        step()


def test_produced_fields_have_their_own_namespace(nacl):
    out = Pipeline([Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))])])(nacl, stress=True)
    assert set(out) == {"energy", "energies", "model_energies", "forces", "stress", "virial", "fields", "halo"}
    assert set(out["fields"]) == {"charges"}
    # Charge conservation of ChargeModel (an independent property): the charges sum to the system's net charge, 0.
    assert abs(float(out["fields"]["charges"].sum())) < 1e-12


def test_one_owner_of_the_skin():
    from halopipe.domain import DEFAULT_SKIN

    assert Pipeline([LennardJones(**LJ)]).config == DomainConfig(skin=DEFAULT_SKIN)
    with pytest.raises(TypeError, match="DomainConfig"):
        Pipeline([LennardJones(**LJ)], config={"skin": 1.0})
    with pytest.raises(ValueError, match="skin must be a finite number"):
        DomainConfig(skin=-1.0)


def test_a_domain_is_evaluated_as_given(nacl):
    from halopipe.domain import LocalDomain

    pipe = Pipeline([Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2))])], config=DomainConfig(skin=0.5))
    on_domain = pipe(LocalDomain(nacl, skin=0.5), stress=True)
    on_system = pipe(nacl, stress=True)
    assert float(on_domain["energy"]) == float(on_system["energy"])
    assert torch.equal(on_domain["forces"], on_system["forces"])
    with pytest.raises(ValueError, match="skin 0.5 differs from the domain's skin 0.0"):
        pipe(LocalDomain(nacl, skin=0.0))


@pytest.mark.timeout(240)
def test_unchanged_script_runs_decomposed_under_a_process_group():
    from halopipe.distributed.launch import spawn

    from .distributed._workers import unchanged_script

    for r in spawn(unchanged_script, 2, timeout=200):
        assert r["world"] == 2 and r["shape"] == (128, 3)
        assert r["energy_rel"] < 1e-12 and r["again_energy_rel"] < 1e-12, r
        assert r["force"] < 1e-10 and r["energies"] < 1e-10 and r["charges"] < 1e-12 and r["stress_rel"] < 1e-12, r
        assert "skin 0.5 differs from the system's skin 0.75" in r["mismatch"], r


class _Produces(Model):
    cutoff = 1.0

    def __init__(self, name: str):
        super().__init__()
        self.outputs = frozenset({name})
