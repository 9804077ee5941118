"""Compiled models under decomposition: equal to the eager model on one process, and no recompiles while atoms migrate."""

import pytest

from halopipe.distributed.launch import spawn

from ._compile_workers import compiled_walk, compiled_wired_group

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size, grid", [(1, None), (2, None), (4, (2, 2, 1))])
def test_compiled_network_in_a_wired_group_equals_eager_single_process(world_size, grid):
    r = spawn(compiled_wired_group, world_size, grid, timeout=580)[0]
    assert r["compilations_min"] > 0, r  # every rank really ran compiled stages
    assert r["energy_rel"] < 1e-12, r
    assert r["force"] < 1e-10, r
    assert r["stress_rel"] < 1e-12, r


@pytest.mark.timeout(600)
def test_a_walk_with_migration_compiles_once():
    """Rebuilds change every atom, ghost and edge count; dynamic shapes keep the first graphs."""
    r = spawn(compiled_walk, 2, 40, None, 0.6, timeout=580)[0]
    assert r["rebuilds"] > 5, r  # the walk really rebuilt (and migrated) on every rank
    assert r["last"] == r["first"] > 0, r
    assert r["energy_rel"] < 1e-12 and r["force"] < 1e-10, r
