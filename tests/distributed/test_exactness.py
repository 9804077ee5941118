"""Distributed vs single-process evaluation on CPU with gloo: equal to float64 rounding.

Each world size runs in one spawn of processes; each case differs in grid,
periodicity and halo mode. The test system (128 atoms, heights ~15 Å) makes
the 9 Å halo wider than a brick on most grids and wider than half the box.
"""

import pytest

from halopipe.distributed.launch import spawn

from ._workers import run_cases

CASES = {
    1: [
        dict(system_kind="triclinic", grid=(1, 1, 1)),
        dict(system_kind="mixed", grid=(1, 1, 1)),
        dict(system_kind="small_box", grid=(1, 1, 1)),
    ],
    2: [
        dict(system_kind="triclinic", grid=(2, 1, 1)),
        dict(system_kind="mixed", grid=(1, 2, 1)),
        dict(system_kind="triclinic", grid=(1, 1, 2), halo="max"),
    ],
    3: [dict(system_kind="triclinic", grid=(3, 1, 1)), dict(system_kind="mixed", grid=(1, 3, 1))],
    4: [
        dict(system_kind="triclinic", grid=(2, 2, 1)),
        dict(system_kind="triclinic", grid=(4, 1, 1), skin=0.7),
        dict(system_kind="mixed", grid=(1, 2, 2)),
        dict(system_kind="small_box", grid=(2, 1, 2)),
    ],
    6: [dict(system_kind="triclinic", grid=(3, 2, 1)), dict(system_kind="mixed", grid=(1, 3, 2))],
    8: [
        dict(system_kind="triclinic", grid=(2, 2, 2)),
        dict(system_kind="triclinic", grid=(8, 1, 1)),
        dict(system_kind="mixed", grid=(2, 4, 1)),
    ],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_distributed_equals_single_process(world_size):
    results = spawn(run_cases, world_size, CASES[world_size], timeout=360)[0]
    for case, r in zip(CASES[world_size], results):
        label = f"{world_size} ranks {case}"
        assert r["owned_once"], label
        assert r["energy_rel"] < 1e-12, (label, r)
        assert r["energies_rel"] < 1e-12, (label, r)
        assert r["atom_energies"] < 1e-12, (label, r)  # eV, per atom
        assert r["force"] < 1e-10, (label, r)
        assert r["forces_only_equal"], (label, "forces without energy or stress must be the same bits")
        assert r["charges"] < 1e-12, (label, r)
        if "stress_rel" in r:
            assert r["stress_rel"] < 1e-12, (label, r)
        assert tuple(r["grid"]) == case["grid"]
