"""The slab-decomposed FFT and the box <-> slab maps against torch.fft and a full-mesh sum.

Mesh sizes are chosen so that no axis divides evenly by the number of ranks,
and on 4 ranks the first axis (3) is smaller than the world: a rank holds no plane.
Gradients come from autograd through the distributed transposes and are
compared with autograd through torch.fft on the full mesh.
"""

import pytest

from halopipe.distributed.launch import spawn

from ._fft_workers import run_fft_cases

SIZES = [(7, 5, 6), (5, 9, 4), (3, 6, 5)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_slab_fft_equals_full_mesh_fft(world_size):
    results = spawn(run_fft_cases, world_size, SIZES, timeout=180)
    for rank, per_rank in enumerate(results):
        ffts, boxes = per_rank[: len(SIZES)], per_rank[len(SIZES) :]
        for sizes, r in zip(SIZES, ffts):
            label = (world_size, rank, sizes)
            assert r["spectrum"] < 1e-13, (label, r)
            assert r["roundtrip"] < 1e-12, (label, r)
            assert r["loss_rel"] < 1e-12, (label, r)
            assert r["grad_rel"] < 1e-12, (label, r)
        for sizes, r in zip(SIZES, boxes):
            label = (world_size, rank, sizes)
            assert r["slab"] < 1e-12, (label, r)
            assert r["loss_rel"] < 1e-12, (label, r)
            assert r["grad_rel"] < 1e-12, (label, r)
