"""Cached k-space data (PME filter, Ewald k-vectors) follow the cell: one model reused across cells equals fresh models."""

import pytest
import torch

from halopipe import Ewald, Group, Pipeline, Step
from halopipe.models.pme import PME

from ..conftest import random_ionic_cell


def _evaluate(model, system, stress=False):
    return Pipeline([Group([Step(model)], autograd=True)])(system, stress=stress)


@pytest.mark.parametrize(
    "factory", [lambda: Ewald(cutoff=5.0, accuracy=1e-8), lambda: PME(cutoff=5.0, accuracy=1e-5)], ids=["Ewald", "PME"]
)
def test_reused_model_follows_cell_changes(factory):
    system = random_ionic_cell(n_cells=2, seed=21)
    stretched = system.replace(positions=system.positions * 1.03, cell=system.cell * 1.03)
    reused = factory()
    for s in (system, stretched, system, stretched):  # alternate: each call after the first hits or misses the cache
        want = _evaluate(factory(), s, stress=True)
        got = _evaluate(reused, s)
        assert float(got["energy"]) == pytest.approx(float(want["energy"]), rel=1e-13)
        torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-12)
        # The strained-cell path (stress) must bypass the cache and still agree with a fresh model.
        torch.testing.assert_close(_evaluate(reused, s, stress=True)["stress"], want["stress"], rtol=0, atol=1e-13)
