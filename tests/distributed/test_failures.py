"""Failures end the whole job quickly, with the failing rank's message, and leave no rank behind.

The time from the raise (recorded by the failing model) to the moment ``spawn`` has joined every rank is
bounded well below the default 120 s communication timeout: failing ranks report through the rendezvous
store, and waiting ranks look there while they wait.
"""

import math
import time
from pathlib import Path

import pytest

from halopipe.distributed.launch import SpawnError, spawn

from ._lifetime_workers import alive, evaluate_after_a_failure, misbehave, rank_pids


def _spawn_failing(directory: Path, nproc: int, how: str, ranks: list[int], timeout: float | None = None) -> SpawnError:
    with pytest.raises(SpawnError) as info:
        spawn(misbehave, nproc, how, ranks, str(directory), timeout, timeout=math.inf)
    pids = rank_pids(directory)
    assert len(pids) == nproc and not [pid for pid in pids if alive(pid)], pids
    return info.value


def _seconds_since_raise(directory: Path) -> float:
    return time.time() - min(float(f.read_text()) for f in directory.glob("raise-*"))


@pytest.mark.timeout(120)
def test_the_same_error_on_every_rank_ends_the_job_at_once(tmp_path):
    error = _spawn_failing(tmp_path, 2, "raise", [0, 1])
    seconds = _seconds_since_raise(tmp_path)
    assert seconds < 5, seconds  # the default communication timeout is 120 s
    assert error.rank in (0, 1)
    assert "model exploded on purpose" in error.message and "\n" not in error.message, error.message
    assert "Traceback" in error.details and "ValueError: model exploded on purpose" in error.details


@pytest.mark.timeout(120)
def test_an_error_on_one_rank_ends_every_rank_well_before_the_timeout(tmp_path):
    error = _spawn_failing(tmp_path, 2, "raise", [1])
    seconds = _seconds_since_raise(tmp_path)
    assert seconds < 5, seconds
    assert error.rank == 1
    assert error.message.startswith("rank 1 failed during pipeline evaluation: ValueError: model exploded on purpose"), error.message
    assert 'in forward\n    raise ValueError("model exploded on purpose")' in error.details  # the failing rank's own traceback


@pytest.mark.timeout(120)
def test_a_stalled_rank_does_not_hang_the_launcher_without_a_timeout(tmp_path):
    """Rank 1 sleeps inside a model; rank 0 times out (2 s) and the launcher stops rank 1, although spawn has timeout=inf."""
    t0 = time.monotonic()
    error = _spawn_failing(tmp_path, 2, "stall", [1], timeout=2.0)
    seconds = time.monotonic() - t0
    assert seconds < 40, seconds
    assert error.rank == 0
    assert "no rank reported a cause" in error.message and "rank(s) [1] had not finished and were stopped" in error.message, error.message


@pytest.mark.timeout(200)
def test_after_a_failure_a_new_scatter_communicates_correctly():
    r = spawn(evaluate_after_a_failure, 2, timeout=180)[0]
    assert r["message"].startswith("rank 1 failed during a step that fails on rank 1: ValueError: failed on purpose"), r
    assert "failed earlier" in r["spent"], r  # the spent group refuses further use
    assert r["energy_rel"] < 1e-12 and r["force"] < 1e-10, r
