"""The empty-view part of the conformance check catches models that would leave their peers waiting."""

from __future__ import annotations

import pytest
import torch

from halopipe import LennardJones, Model, ModelOutput
from halopipe.testing import check_empty_view

from ..conftest import triclinic_nacl


class SkipsWhenEmpty(Model):
    """Returns early on a rank without atoms: its peers wait for its refresh."""

    cutoff = 3.0

    def forward(self, view, direct=False):
        if view.n_owned == 0:
            return ModelOutput(energies=view.positions.new_zeros(0))
        x = view.refresh(view.positions[: view.n_owned, 0])
        return ModelOutput(energies=x[: view.n_owned] ** 2)


class DetachesWhenEmpty(Model):
    """Refreshes, but off the graph when empty: the backward exchange never runs on that rank."""

    cutoff = 3.0

    def forward(self, view, direct=False):
        x = view.positions[: view.n_owned, 0]
        x = x.detach() if view.n_owned == 0 else x
        y = view.refresh(x)
        return ModelOutput(energies=y[: view.n_owned] ** 2 + view.global_sum(y.sum()) * 0.0)


class EnergyOnGhosts(Model):
    """Returns an energy on every row, a rank's ghost rows included even where it owns no atom to pair them with."""

    cutoff = 3.0

    def forward(self, view, direct=False):
        return ModelOutput(energies=view.positions[:, 0] * 0.0 + 1.0)


class CrashesWhenEmpty(Model):
    """Reshapes owned rows with an inferred dimension, as mace's symmetric contraction does."""

    cutoff = 3.0

    def forward(self, view, direct=False):
        per_owned = view.positions[: view.n_owned].reshape(view.n_owned, -1)
        return ModelOutput(energies=per_owned.sum(dim=1) * 0.0)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (SkipsWhenEmpty(), "calls the collectives"),
        (DetachesWhenEmpty(), r"refresh\(\)\.backward"),
        (EnergyOnGhosts(), "energies of shape"),
        (CrashesWhenEmpty(), "raised RuntimeError"),
    ],
)
def test_empty_view_check_fails_for_broken_models(model, message):
    with pytest.raises(AssertionError, match=message):
        check_empty_view(model, triclinic_nacl())


def test_empty_view_check_passes_for_a_correct_model():
    check_empty_view(LennardJones({11: 0.0115, 17: 0.0043}, {11: 2.6, 17: 3.6}, 6.0), triclinic_nacl())
    assert torch.get_default_dtype() == torch.float64
