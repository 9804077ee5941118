"""The shared-memory path of ranks on one host gives gloo's results, leaves no file behind and notices dead peers."""

import math
from pathlib import Path

import pytest

from halopipe.distributed.launch import SpawnError, spawn

from ._shm_workers import CAPACITY, die_in_a_reduction, traffic


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("halopipe-*")} if Path("/dev/shm").is_dir() else set()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("capacity", [CAPACITY, 0])
def test_reductions_and_messages_through_shared_memory_and_gloo_agree(capacity):
    """3 ranks, buffers of 64 KiB (larger items go through gloo) or shared memory off: every value checked in the ranks."""
    before = _segments()
    results = spawn(traffic, 3, capacity, timeout=150)
    assert all(r["shared_memory"] == bool(capacity) for r in results), results
    # Summed in rank order from the same slots: bitwise the same on every rank.
    assert results[0]["reductions"] == results[1]["reductions"] == results[2]["reductions"]
    assert _segments() <= before  # the segment is unlinked once every rank has mapped it


@pytest.mark.timeout(120)
def test_a_peer_that_dies_without_a_word_ends_the_shared_memory_wait(tmp_path):
    """Rank 1 exits; rank 0, spinning in a reduction, sees its pid gone and raises naming it (not after the 60 s timeout)."""
    with pytest.raises(SpawnError):
        spawn(die_in_a_reduction, 2, str(tmp_path), timeout=math.inf)
    died = float((tmp_path / "died").read_text())
    raised, message = (tmp_path / "rank0").read_text().split("\n", 1)
    assert float(raised) - died < 5, (died, raised)
    assert "rank 1 died during communication" in message, message
