"""A batch under domain decomposition equals one process per system (gloo, CPU), and its failures reach every rank."""

import pytest

from halopipe.distributed.launch import spawn
from halopipe.distributed.pipeline import balanced_placement

from ._batch_workers import all_cases, empty_system, failing_gather, failing_species


def test_placement_splits_large_systems_and_balances_the_rest():
    split, whole = balanced_placement([10, 500, 40, 30, 20, 60, 5], n_ranks=2, split_atoms=100)
    assert split == [1]  # 500 atoms >= 100 per rank on 2 ranks
    loads = [sum([10, 500, 40, 30, 20, 60, 5][b] for b in rank) for rank in whole]
    assert sorted(b for rank in whole for b in rank) == [0, 2, 3, 4, 5, 6]
    assert abs(loads[0] - loads[1]) <= 60  # within one system's atoms (LPT)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_batch_equals_one_process_per_system(world_size):
    results = spawn(all_cases, world_size, timeout=400)[0]
    for name, r in results.items():
        assert r["n_systems"] >= 3, (name, r)
        assert r["force"] < 1e-10 and r["energy_rel"] < 1e-12 and r["stress"] < 1e-12, (name, r)
        assert r["fields"] < 1e-12 and r["gradient"] < 1e-10, (name, r)


@pytest.mark.timeout(120)
def test_a_model_error_on_one_rank_reaches_every_rank_with_its_cause():
    for message in spawn(failing_species, 3, timeout=100):
        assert "system 1 of the batch: LennardJones" in message and "118" in message, message


@pytest.mark.timeout(120)
def test_an_error_inside_gather_reaches_every_rank_with_its_cause():
    for message in spawn(failing_gather, 3, timeout=100):
        assert "rank 1 failed during gather" in message, message


@pytest.mark.timeout(120)
def test_a_system_of_no_atoms_alone_and_in_a_batch():
    for result in spawn(empty_system, 3, timeout=100):
        assert result == ((0, 3), 0.0, (0, 3), [0.0, 0.0]), result
