"""One pipeline object evaluating many frames in a row equals a fresh pipeline per frame.

Frames: a system, the same system rattled beyond the skin, a system with another atom count, and the first again;
each is freshly scattered. Caches must never hand one system's pairs to another (they once keyed on a per-system
plan counter that repeats across systems).
"""

import pytest

from halopipe.distributed.launch import spawn

from ._workers import reuse_case


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_reused_pipeline_equals_fresh_pipelines(world_size):
    diffs = spawn(reuse_case, world_size, timeout=240)[0]
    assert [d["n_atoms"] for d in diffs] == [128, 128, 16, 128]
    for k, d in enumerate(diffs):
        label = f"{world_size} ranks, frame {k}: {d}"
        assert d["distributed_energy"] < 1e-12, label
        assert d["distributed_force"] < 1e-10, label
        assert d["distributed_charges"] < 1e-12, label
        assert d["single_energy"] < 1e-12, label
        assert d["single_force"] < 1e-10, label
        assert d["vs_single_force"] < 1e-10, label
