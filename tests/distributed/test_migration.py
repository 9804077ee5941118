import pytest
import torch

from halopipe.distributed.launch import spawn
from halopipe.distributed.sharded import _id_order_source

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


def test_merged_rows_follow_a_stable_sort_of_all_ids():
    """The rows after a migration (staying rows in id order, arrivals slotted in) are those of one sort of every id."""
    gen = torch.Generator().manual_seed(3)
    for n, k in [(0, 5), (7, 0), (0, 0), (300, 40), (2000, 1)]:
        ids = torch.randperm(4 * (n + k) + 1, generator=gen)[: n + k]
        owned_ids = ids[:n].sort().values  # owned rows are kept in id order
        staying = torch.nonzero(torch.rand(n, generator=gen) < 0.8)[:, 0]
        arrived = ids[n:]  # in any order: blocks from several peers
        every = torch.cat([owned_ids.index_select(0, staying), arrived])
        expected = torch.cat([staying, torch.arange(n, n + k)]).index_select(0, torch.argsort(every, stable=True))
        assert torch.equal(_id_order_source(staying, owned_ids.index_select(0, staying), arrived, n), expected), (n, k)
