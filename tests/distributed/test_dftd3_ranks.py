"""DFT-D3 under domain decomposition equals one process (gloo, CPU), and bad input fails on every rank without a hang.

Reference: the same pipeline evaluated in one process (``decompose=False``) on rank 0. Tolerances:
forces 1e-10 eV/Å, energy 1e-12 relative, stress 1e-12 relative to its largest component.
Cases: D3(BJ)/PBE at the default cutoffs (two-body 50.2 Å, CN 21.2 Å: several boxes wide) and
D3(BJ)-ATM (s9 = 1) at smaller cutoffs, on 64 rattled Si atoms and on a 20-atom triclinic cell
(angles 63°, 112°, 72°), on 1, 2, 4 and 8 ranks with slab (4,1,1), pencil (2,2,1) and (2,2,2) brick grids.
"""

import math
import time

import pytest

from halopipe.distributed.launch import SpawnError, spawn

from ._dftd3_workers import decomposed_vs_one_process, unknown_element
from ._lifetime_workers import alive, rank_pids

CASES = {
    "1_rank": (1, [("silicon", "default", (1, 1, 1)), ("triclinic", "default", (1, 1, 1))]),
    "2_ranks": (
        2,
        [
            ("silicon", "default", (2, 1, 1)),
            ("triclinic", "default", (1, 2, 1)),
            ("silicon", "atm", (1, 1, 2)),
            ("triclinic", "atm", (2, 1, 1)),
        ],
    ),
    "4_ranks_4x1x1": (4, [("silicon", "default", (4, 1, 1)), ("triclinic", "atm", (4, 1, 1))]),
    "4_ranks_2x2x1": (4, [("triclinic", "default", (2, 2, 1)), ("silicon", "atm", (2, 2, 1))]),
    "8_ranks_2x2x2": (8, [("silicon", "default", (2, 2, 2))]),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("label", sorted(CASES))
def test_decomposed_equals_one_process(label):
    world, cases = CASES[label]
    results = spawn(decomposed_vs_one_process, world, cases, timeout=160)[0]
    assert len(results) == len(cases)
    for r in results:
        assert r["grid"] == r["case"][2], r
        assert r["energy_rel"] <= 1e-12, r
        assert r["force"] <= 1e-10, r
        assert r["stress_rel"] <= 1e-12, r


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["everywhere", "one_rank"])
def test_element_without_reference_data_on_two_ranks(tmp_path, where):
    """Z = 104 on 2 ranks: a SpawnError naming the value, at once (not after the 120 s timeout), and no rank left running."""
    t0 = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(unknown_element, 2, str(tmp_path), where, timeout=math.inf)
    seconds = time.monotonic() - t0
    pids = rank_pids(tmp_path)
    assert len(pids) == 2 and not [pid for pid in pids if alive(pid)], pids
    assert seconds < 60, seconds
    error = info.value
    assert "ValueError: DFTD3: no D3 reference data for atomic number 104" in error.message, error.message
    assert "1..103" in error.message, error.message
    # The error reaches every rank: each one reports it (rank 1 with "reported on rank 1" where it learnt it from rank 0).
    assert sorted(error.failures) == [0, 1], error.failures
    assert all("atomic number 104" in line for line in error.failures.values()), error.failures
