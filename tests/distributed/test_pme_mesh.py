"""PME with the distributed (slab) mesh under domain decomposition equals the replicated mesh on one process.

Mesh sizes do not divide by the number of ranks; on 8 ranks one mesh has
fewer planes (6) than ranks, so some ranks hold no plane. Energy, forces and
stress are compared for fixed charges and for position-dependent charges
(ChargeModel -> PME), whose forces carry dE/dq.
"""

import pytest

from halopipe.distributed.launch import spawn

from ._fft_workers import run_pme_cases

CASES = {
    1: [dict(grid=(1, 1, 1), sizes=(15, 10, 12))],
    2: [dict(grid=(2, 1, 1), sizes=(15, 10, 12)), dict(grid=(1, 1, 2), sizes=(9, 11, 10))],
    3: [dict(grid=(3, 1, 1), sizes=(10, 10, 12)), dict(grid=(1, 3, 1), sizes=(16, 10, 9))],
    4: [dict(grid=(2, 2, 1), sizes=(15, 10, 12))],
    6: [dict(grid=(3, 2, 1), sizes=(16, 10, 9))],
    8: [dict(grid=(2, 2, 2), sizes=(15, 10, 12)), dict(grid=(2, 2, 2), sizes=(6, 9, 10))],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_distributed_mesh_equals_replicated(world_size):
    results = spawn(run_pme_cases, world_size, CASES[world_size], timeout=360)[0]
    for case, r in zip(CASES[world_size], results):
        for name in ("fixed_charges", "charge_model"):
            label = (world_size, case, name, r[name])
            assert r[name]["energy_rel"] < 1e-12, label
            assert r[name]["force"] < 1e-10, label
            assert r[name]["stress"] < 1e-10, label
