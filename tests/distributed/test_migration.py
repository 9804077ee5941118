import pytest

from halopipe.distributed.launch import spawn

from ._workers import migration_walk


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, grid", [(4, (2, 2, 1)), (3, (1, 1, 3))])
def test_random_walk_rebuilds_migrates_and_stays_exact(world_size, grid):
    r = spawn(migration_walk, world_size, 300, grid, 0.6, timeout=280)[0]
    assert r["ids_once"]  # no atom lost or duplicated
    assert all(r["carried"]), r["carried"]  # species, masses and every field (float, integer, vector) followed their atom
    assert r["positions"] < 1e-12
    assert r["rebuilds"] > 10 and r["owner_changes"] > 10, r  # the walk really rebuilt and migrated
    assert r["plans_equal"], r  # a migration's placement, carried, is that of every row placed again
    assert r["energy_rel"] < 1e-12 and r["force"] < 1e-10, r
