"""Binding ranks to cores: the assignment, the launcher's ranks, and when it stays away."""

from __future__ import annotations

import os

import pytest

from halopipe.distributed.affinity import bind_local_rank, cores_for_rank, cpu_list
from halopipe.distributed.launch import spawn

from ._workers import affinity


def test_cores_for_rank_hands_out_consecutive_cores_in_order():
    assert cores_for_rank(0, 2, 1, [3, 1]) == [1]
    assert cores_for_rank(1, 2, 1, [3, 1]) == [3]
    assert cores_for_rank(1, 2, 2, [0, 1, 2, 3]) == [2, 3]
    assert cores_for_rank(2, 3, 2, list(range(8))) == [4, 5]


def test_ranks_take_one_thread_of_each_core_before_any_second_thread():
    side_by_side = lambda cpu: [cpu - cpu % 2, cpu - cpu % 2 + 1]  # noqa: E731 - CPUs 0-1 one core, 2-3 the next, ...
    apart = lambda cpu: [cpu % 4, cpu % 4 + 4]  # noqa: E731 - CPUs 0-3 four cores, 4-7 their second threads
    assert [cores_for_rank(r, 2, 2, list(range(8)), side_by_side) for r in range(2)] == [[0, 2], [4, 6]]
    assert [cores_for_rank(r, 2, 2, list(range(8)), apart) for r in range(2)] == [[0, 1], [2, 3]]
    assert [cores_for_rank(r, 8, 1, list(range(8)), side_by_side) for r in (3, 4)] == [[6], [1]]  # then second threads


def test_linux_cpu_lists_are_read():
    assert cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_list("5") == [5]


@pytest.mark.parametrize("args", [(0, 3, 1, [0, 1]), (0, 2, 2, [0, 1, 2]), (2, 2, 1, [0, 1]), (0, 1, 0, [0])])
def test_cores_for_rank_refuses_ranks_that_do_not_fit(args):
    assert cores_for_rank(*args) is None


@pytest.fixture
def restored_affinity():
    before = os.sched_getaffinity(0)
    yield sorted(before)
    os.sched_setaffinity(0, before)


def test_an_already_bound_process_is_left_alone_when_asked(restored_affinity):
    os.sched_setaffinity(0, restored_affinity[:1])  # as srun or taskset would
    assert bind_local_rank(0, 1, 1, only_if_unbound=True) is None
    assert sorted(os.sched_getaffinity(0)) == restored_affinity[:1]


def test_binding_is_turned_off_by_the_environment(restored_affinity, monkeypatch):
    monkeypatch.setenv("HALOPIPE_BIND_CORES", "0")
    assert bind_local_rank(0, 1, 1) is None
    assert sorted(os.sched_getaffinity(0)) == restored_affinity


def test_binding_a_rank_restricts_it_to_its_cores(restored_affinity):
    cores = bind_local_rank(len(restored_affinity) - 1, len(restored_affinity), 1)
    assert cores == restored_affinity[-1:]
    assert sorted(os.sched_getaffinity(0)) == restored_affinity[-1:]


@pytest.mark.timeout(120)
def test_spawned_ranks_each_run_on_their_own_core():
    available = sorted(os.sched_getaffinity(0))
    nproc = min(2, len(available))
    assert spawn(affinity, nproc, timeout=90) == [[available[r]] for r in range(nproc)]


@pytest.mark.timeout(120)
def test_spawned_ranks_that_do_not_fit_the_cores_stay_unbound():
    available = sorted(os.sched_getaffinity(0))
    # 2 ranks of as many threads as there are cores: twice what fits
    assert spawn(affinity, 2, timeout=90, threads=len(available)) == [available] * 2
