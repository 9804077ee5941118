"""Per-atom gathers: to rank 0 (trajectories, checkpoints) and to every rank, against the scattered system."""

import pytest

from halopipe.distributed.launch import spawn

from ._fft_workers import gather_case


@pytest.mark.timeout(120)
def test_gather_to_rank0_and_everywhere():
    results = spawn(gather_case, 3, timeout=100)
    root = results[0]
    assert root["root"] == 0.0 and root["numbers_equal"] and root["masses"] == 0.0
    for r in results:
        assert r["everywhere"] == 0.0
    for r in results[1:]:
        assert r["root_is_none"]
        # A non-root rank sends its own rows (id + 3 coordinates, float64) once: nothing proportional to N.
        assert r["sent"] == r["owned"] * 4 * 8
