"""Non-finite energies or forces raise an error that names the model (one process and across ranks)."""

from __future__ import annotations

import pytest
import torch

from halopipe import DomainConfig, Group, LennardJones, Model, ModelOutput, NonFiniteError, Pipeline, Step
from halopipe.distributed import DistributedError, ShardedSystem
from halopipe.distributed.launch import spawn

from ..conftest import triclinic_nacl


class NanOnAtom(Model):
    """A finite energy everywhere except on one atom, wherever that atom is owned."""

    cutoff = 3.0

    def __init__(self, atom: int = 5) -> None:
        super().__init__()
        self.atom = atom

    def forward(self, view, direct=False):
        x = view.positions[: view.n_owned, 0]
        bad = view.ids[: view.n_owned] == self.atom
        return ModelOutput(energies=torch.where(bad, torch.full_like(x, float("nan")), 0.01 * x))


class InfiniteSlope(Model):
    """Energy sqrt(|x - x0|) at x = x0: finite (zero) energy, infinite force."""

    cutoff = 3.0

    def forward(self, view, direct=False):
        x = view.positions[: view.n_owned, 0]
        return ModelOutput(energies=torch.sqrt((x - x.detach()).abs()))


def test_non_finite_energy_names_the_model():
    system = triclinic_nacl()
    with pytest.raises(NonFiniteError, match=r"^NanOnAtom returned a non-finite energy \(nan\)") as info:
        Pipeline([LennardJones(cutoff=4.0), NanOnAtom()])(system)
    assert info.value.model == "NanOnAtom"
    with pytest.raises(NonFiniteError, match=r"^bad_term \(NanOnAtom\) returned a non-finite energy"):
        Pipeline([Group([Step(LennardJones(cutoff=4.0)), Step(NanOnAtom(), name="bad_term")])])(system)


def test_non_finite_forces_name_the_group():
    system = triclinic_nacl()
    with pytest.raises(NonFiniteError, match=r"^non-finite forces or virial from InfiniteSlope;") as info:
        Pipeline([Group([Step(InfiniteSlope())])])(system)
    assert info.value.model == "InfiniteSlope"
    with pytest.raises(NonFiniteError, match=r"from LennardJones, InfiniteSlope;"):
        Pipeline([Group([Step(LennardJones(cutoff=4.0)), Step(InfiniteSlope())])])(system, stress=True)


def test_coincident_atoms_with_the_check_disabled_give_a_named_error_not_nan():
    system = triclinic_nacl()
    positions = system.positions.clone()
    positions[3] = positions[2]
    overlapping = system.replace(positions=positions, min_distance=0.0)
    with pytest.raises(NonFiniteError, match="LennardJones returned a non-finite energy"):
        Pipeline([LennardJones(cutoff=4.0)])(overlapping)


def test_error_is_easy_to_prefix_with_the_step():
    try:
        Pipeline([NanOnAtom()])(triclinic_nacl())
    except NonFiniteError as exc:
        prefixed = NonFiniteError(f"step 12: {exc}", exc.model)
    assert str(prefixed).startswith("step 12: NanOnAtom returned a non-finite energy") and prefixed.model == "NanOnAtom"


def _distributed_nan() -> str:
    """Every rank ends with the same error naming the model, also those that did not produce the nan."""
    config = DomainConfig(timeout=10)
    system = triclinic_nacl((3, 3, 3))
    sharded = ShardedSystem.scatter(system if torch.distributed.get_rank() == 0 else None, config)
    owns_bad = bool((sharded.ids == 5).any())
    try:
        Pipeline([LennardJones(cutoff=4.0), NanOnAtom(5)], config=config)(sharded)
    except (NonFiniteError, DistributedError) as exc:
        return f"{owns_bad}: {exc}"
    return f"{owns_bad}: no error"


@pytest.mark.timeout(120)
def test_non_finite_energy_on_one_rank_fails_every_rank_naming_the_model():
    messages = spawn(_distributed_nan, 2, timeout=100)
    assert sorted(m.split(":")[0] for m in messages) == ["False", "True"]  # one rank owns the atom, the other does not
    for m in messages:
        assert "NanOnAtom returned a non-finite energy (nan)" in m, messages
