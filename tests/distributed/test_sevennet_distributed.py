"""SevenNet-0 (+ DFTD3) under domain decomposition equals single-process evaluation (gloo, CPU, float64).

Bricks are thinner than the 5 Å cutoff, so ghost rows come from several bricks
away and their features must be refreshed between each of the five layers.
"""

import pytest

pytest.importorskip("sevenn")

from halopipe.distributed.launch import spawn

from ._sevennet_workers import empty_rank_case, sevennet_cases, wide_halo_case

pytestmark = [pytest.mark.sevenn, pytest.mark.filterwarnings("ignore::UserWarning")]

GRIDS = {1: (1, 1, 1), 2: (2, 1, 1), 3: (3, 1, 1), 4: (2, 2, 1)}


def assert_equal_to_single_process(r: dict) -> None:
    assert r["energy_rel"] < 1e-12, r
    assert r["force"] < 1e-9, r
    if "stress_rel" in r:
        assert r["stress_rel"] < 1e-10, r


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", sorted(GRIDS))
def test_sevennet_and_sevennet_plus_d3_distributed(world_size):
    grid = GRIDS[world_size]
    results = spawn(sevennet_cases, world_size, grid, timeout=380)[0]
    for r in results:
        assert_equal_to_single_process(r)
        if world_size > 1:
            assert r["thickest_split_brick"] < 5.0, r  # every split axis: bricks thinner than the cutoff


@pytest.mark.timeout(300)
def test_ranks_without_atoms_contribute_zero():
    r = spawn(empty_rank_case, 4, timeout=280)[0]
    assert r["fewest_owned"] == 0, r
    assert_equal_to_single_process(r)


@pytest.mark.timeout(300)
def test_wide_halo_distributed():
    assert_equal_to_single_process(spawn(wide_halo_case, 2, (2, 1, 1), timeout=280)[0])
