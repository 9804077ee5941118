"""Ranks that own no atoms contribute nothing and still meet every collective, for every model.

A slab with vacuum along a periodic axis on four bricks along z: some ranks own
no atoms (with or without ghost rows). Distributed energy, forces and stress
must equal the single-process ones (gloo, CPU, float64).
"""

import importlib.util

import pytest

from halopipe.distributed.launch import spawn

from ._empty_workers import empty_rank_cases

MODELS = [
    "lj_direct",
    "lj_autograd",
    "dsf",
    "charges_dsf",
    "d3_direct",
    "d3_autograd",
    "ewald",
    "charges_pme",
    "torch_per_layer",
    "torch_wide",
    "mace_layer",
    "mace_wide",
]
NO_GHOSTS = {"d3_direct", "d3_autograd"}  # D3 sums periodic images in its kernels: it asks for no ghost rows


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("bottom", "owned"), [(1.0, [64, 0, 0, 0]), (6.0, [32, 32, 0, 0])])
def test_every_model_with_empty_ranks(bottom, owned):
    models = MODELS if importlib.util.find_spec("mace") else MODELS[:-2]
    results = spawn(empty_rank_cases, 4, models, bottom, timeout=580)[0]
    assert results["owned_per_rank"] == owned
    ghosts = results["ghosts_per_rank"]
    # The layouts the test is about: an empty rank with ghost rows, for every model when the slab sits in brick 0.
    if bottom == 1.0:
        assert all(ghosts[name][1] > 0 and ghosts[name][3] > 0 for name in models if name not in NO_GHOSTS), ghosts
    assert any(ghosts[name][2] == 0 for name in models), ghosts  # and an empty rank without any row
    for name in models:
        r = results[name]
        assert r["energy_rel"] < 1e-12, (name, r)
        assert r["force"] < 1e-10, (name, r)
        assert r["stress_rel"] < 1e-12, (name, r)
