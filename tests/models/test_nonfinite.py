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


class InfiniteSlopeOnAtom(Model):
    """Energy 0.01 x, plus sqrt(|x - x0|) (zero, with an infinite slope) on one atom from the ``from_call``-th evaluation on."""

    cutoff = 3.0

    def __init__(self, atom: int = 5, from_call: int = 1) -> None:
        super().__init__()
        self.atom, self.from_call, self.calls = atom, from_call, 0

    def forward(self, view, direct=False):
        self.calls += 1
        x = view.positions[: view.n_owned, 0]
        energies = 0.01 * x
        if self.calls < self.from_call:
            return ModelOutput(energies=energies)
        bad = torch.nonzero(view.ids[: view.n_owned] == self.atom)[:, 0]
        return ModelOutput(energies=energies.index_add(0, bad, torch.sqrt((x[bad] - x[bad].detach()).abs())))


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


def _distributed_failure(kind: str) -> str:
    """Whether this rank owns atom 5, and the error it ends with: LJ plus a model that fails on that atom, on 2 ranks.

    ``kind``: ``"nan_energy"`` (a full evaluation, whose reduction agrees on
    the failure) or ``"infinite_force"`` (forces only: no reduction, so the
    rank without the atom learns of it at its next communication).
    """
    config = DomainConfig(timeout=10)
    system = triclinic_nacl((3, 3, 3))
    sharded = ShardedSystem.scatter(system if torch.distributed.get_rank() == 0 else None, config)
    owns_bad = bool((sharded.ids == 5).any())
    model, energy = (NanOnAtom(5), True) if kind == "nan_energy" else (InfiniteSlopeOnAtom(5), False)
    try:
        Pipeline([LennardJones(cutoff=4.0), model], config=config)(sharded, energy=energy)
        sharded.all_reduce(torch.ones(1, dtype=torch.float64))  # the next communication, as the next MD step's
    except (NonFiniteError, DistributedError) as exc:
        return f"{owns_bad}: {exc}"
    return f"{owns_bad}: no error"


@pytest.mark.timeout(120)
def test_non_finite_energy_on_one_rank_fails_every_rank_naming_the_model():
    messages = spawn(_distributed_failure, 2, "nan_energy", timeout=100)
    assert sorted(m.split(":")[0] for m in messages) == ["False", "True"]  # one rank owns the atom, the other does not
    for m in messages:
        assert "NanOnAtom returned a non-finite energy (nan)" in m, messages


@pytest.mark.timeout(120)
def test_non_finite_forces_without_energy_fail_every_rank_naming_the_model_and_rank():
    """No reduction agrees on the forces, yet every rank ends with the failing rank's message, not a timeout."""
    messages = spawn(_distributed_failure, 2, "infinite_force", timeout=100)
    assert sorted(m.split(":")[0] for m in messages) == ["False", "True"], messages
    failing = next(i for i, m in enumerate(messages) if m.startswith("True"))
    cause = f"rank {failing} failed during pipeline evaluation: NonFiniteError: non-finite forces or virial from InfiniteSlopeOnAtom"
    for m in messages:
        assert cause in m, messages


def _md_infinite_forces() -> str:
    """An MD run whose forces become infinite on one rank at step 2 (the model's third evaluation), a forces-only step."""
    from halopipe.dynamics import Simulation, VelocityVerlet

    config = DomainConfig(timeout=10)
    pipeline = Pipeline([LennardJones(cutoff=4.0), InfiniteSlopeOnAtom(5, from_call=3)], config=config)
    system = triclinic_nacl((3, 3, 3))
    sim = Simulation(pipeline, system if torch.distributed.get_rank() == 0 else None, VelocityVerlet(1.0))
    try:
        sim.run(5)
    except (NonFiniteError, DistributedError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_infinite_forces_in_md_name_the_step_on_every_rank():
    """The rank that did not fail sees the failure in the next step's rebuild check, yet names the step where it arose."""
    messages = spawn(_md_infinite_forces, 2, timeout=100)
    for m in messages:
        assert m.startswith("MD step 2: rank "), messages
        assert "non-finite forces or virial from InfiniteSlopeOnAtom" in m, messages
