"""PME with the distributed mesh (slabs or pencils) under domain decomposition equals the replicated mesh on one process.

Mesh sizes do not divide by the process grid. ``mesh="distributed"`` lets
the FFT pick its grid (``choose_grid``): slabs on 2 and 3 ranks, pencils on 4,
6 and 8; on 8 ranks one mesh has fewer planes (6) than ranks, where only
pencils balance. ``mesh="slab"`` and ``mesh="pencil"`` force the other
choice, so both decompositions run on 2, 4 and 8 ranks (and ``"replicated"``
the whole mesh on each of 2). Energy, forces and
stress are compared for fixed charges (in an autograd group and as direct
forces) and for position-dependent charges (ChargeModel -> PME), whose
forces carry dE/dq.
"""

import pytest

from halopipe.distributed.launch import spawn

from ._fft_workers import run_pme_cases, run_weighted_pme_cases

# Each case: domain grid, mesh sizes, PME mesh mode, and the FFT process grid (Pr, Pc) it must run on.
CASES = {
    1: [dict(grid=(1, 1, 1), sizes=(15, 10, 12), mesh="distributed", fft=(1, 1))],
    2: [
        dict(grid=(2, 1, 1), sizes=(15, 10, 12), mesh="distributed", fft=(2, 1)),
        dict(grid=(1, 1, 2), sizes=(9, 11, 10), mesh="pencil", fft=(1, 2)),
        dict(grid=(2, 1, 1), sizes=(15, 10, 12), mesh="replicated", fft=(2, 1)),  # every rank the whole mesh
    ],
    3: [
        dict(grid=(3, 1, 1), sizes=(10, 10, 12), mesh="distributed", fft=(1, 3)),
        dict(grid=(1, 3, 1), sizes=(16, 10, 9), mesh="distributed", fft=(3, 1)),
    ],
    4: [
        dict(grid=(2, 2, 1), sizes=(15, 10, 12), mesh="distributed", fft=(2, 2)),
        dict(grid=(2, 2, 1), sizes=(15, 10, 12), mesh="slab", fft=(4, 1)),
    ],
    6: [dict(grid=(3, 2, 1), sizes=(16, 10, 9), mesh="distributed", fft=(3, 2))],
    8: [
        dict(grid=(2, 2, 2), sizes=(6, 9, 10), mesh="distributed", fft=(2, 4)),
        dict(grid=(2, 2, 2), sizes=(15, 10, 12), mesh="slab", fft=(8, 1)),
    ],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_distributed_mesh_equals_replicated(world_size):
    cases = [{k: v for k, v in case.items() if k != "fft"} for case in CASES[world_size]]
    results = spawn(run_pme_cases, world_size, cases, timeout=360)[0]
    for case, r in zip(CASES[world_size], results):
        assert r["process_grid"] == case["fft"], (world_size, case, r["process_grid"])
        for name in ("fixed_charges", "direct", "charge_model"):
            label = (world_size, case, name, r[name])
            assert r[name]["energy_rel"] < 1e-12, label
            assert r[name]["force"] < 1e-10, label
            assert r[name]["stress"] < 1e-10, label


@pytest.mark.timeout(300)
def test_weighted_shares_distributed_equal_single_process():
    """Per-atom weighted PME shares take the exact-adjoint backward (its convolution communicates) on every mesh mode."""
    cases = [dict(grid=(2, 1, 1), sizes=(15, 10, 12), mesh=mode) for mode in ("replicated", "slab", "pencil")]
    for case, r in zip(cases, spawn(run_weighted_pme_cases, 2, cases, timeout=280)[0]):
        assert r["energy_rel"] < 1e-12, (case, r)
        assert r["force"] < 1e-10, (case, r)
        assert r["stress"] < 1e-10, (case, r)
