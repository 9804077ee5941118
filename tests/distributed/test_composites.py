"""Physics composites and MACE under domain decomposition equal single-process evaluation (gloo, CPU)."""

import pytest

from halopipe.distributed.launch import spawn

from ._composite_workers import adapter_cases, mace_cases, physics_composites

COMPOSITES = ["a_lj_d3_direct", "b_charges_ewald_lj", "c_charges_pme", "d_d3_wide"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_physics_composites_distributed(world_size):
    results = spawn(physics_composites, world_size, COMPOSITES, timeout=580)[0]
    for name, r in zip(COMPOSITES, results):
        assert r["energy_rel"] < 1e-12, (name, r)
        assert r["force"] < 1e-10, (name, r)
        assert r["stress_rel"] < 1e-12, (name, r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_mace_and_mace_plus_d3_distributed(world_size):
    pytest.importorskip("mace")
    modes = ["layer", "wide"]
    results = spawn(mace_cases, world_size, modes, timeout=580)[0]
    for r in results:
        assert r["energy_rel"] < 1e-10, r
        assert r["force"] < 1e-9, r
        if "stress_rel" in r:
            assert r["stress_rel"] < 1e-9, r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_bring_your_own_message_passing_distributed(world_size):
    results = spawn(adapter_cases, world_size, ["triclinic", "diamond"], timeout=280)[0]
    for r in results:
        assert r["energy_rel"] < 1e-12, r
        assert r["force"] < 1e-10, r
        assert r["stress_rel"] < 1e-12, r
