"""The slab and pencil FFTs and the box <-> block maps against torch.fft and a full-mesh sum.

Each transform and box map carries a batch of ``BATCH`` meshes (a model's
channels), in the messages of one. Mesh sizes are chosen so that no axis divides evenly by the process grid;
some grids have more rows than the mesh's first axis, so ranks hold nothing
(the slab on 4 ranks with ``n0 = 3``, the 4 x 2 pencil grid with ``n0 = 3``),
and on 8 ranks the pencil runs where the slab cannot balance (``P > n0``).
Gradients come from autograd through the distributed transposes and are
compared with autograd through torch.fft on the full mesh. The traffic each
rank counted is compared with a hand count (``grid_cost``), and a failure on
one rank mid-transform ends every rank through the row and column groups.
"""

import math

import pytest

from halopipe.distributed import Comm
from halopipe.distributed.fft import PencilMeshTransform, choose_grid, grid_cost
from halopipe.distributed.launch import spawn

from ._fft_workers import BATCH, pencil_failure, run_fft_cases, split_case

# (mesh sizes, process grid (Pr, Pc); None: SlabMeshTransform)
CASES = {
    1: [((7, 5, 6), None), ((5, 7, 6), (1, 1))],
    2: [((7, 5, 6), None), ((5, 9, 4), (1, 2))],
    3: [((5, 9, 4), None), ((5, 7, 6), (1, 3))],
    4: [((3, 6, 5), None), ((5, 7, 6), (2, 2))],
    6: [((5, 7, 6), (2, 3)), ((7, 5, 6), (3, 2))],
    8: [((5, 7, 6), (2, 4)), ((3, 6, 5), (4, 2))],
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_distributed_fft_equals_full_mesh_fft(world_size):
    cases = CASES[world_size]
    results = spawn(run_fft_cases, world_size, cases, timeout=180)
    for case_index, (sizes, grid) in enumerate(cases):
        grid = grid or (world_size, 1)
        ffts = [per_rank[case_index] for per_rank in results]
        boxes = [per_rank[len(cases) + case_index] for per_rank in results]
        for rank, (r, b) in enumerate(zip(ffts, boxes)):
            label = (world_size, rank, sizes, grid)
            assert r["grid"] == grid, (label, r)
            assert r["spectrum"] < 1e-13, (label, r)
            assert r["roundtrip"] < 1e-12, (label, r)
            assert r["loss_rel"] < 1e-12, (label, r)
            assert r["grad_rel"] < 1e-12, (label, r)
            assert b["reused"], (label, b)
            assert b["block"] < 1e-12, (label, b)
            assert b["loss_rel"] < 1e-12, (label, b)
            assert b["grad_rel"] < 1e-12, (label, b)
            # A rank talks to its grid row and column only, and holds at most its balanced block.
            assert r["forward_messages"] <= grid[0] + grid[1] - 2, (label, r)
            assert r["points"] <= math.ceil(sizes[0] / grid[0]) * math.ceil(sizes[1] / grid[1]) * sizes[2], (label, r)
        # A batch of meshes moves in the messages of one mesh, each BATCH times the bytes.
        expected = grid_cost(sizes, grid)
        assert max(r["forward_bytes"] for r in ffts) == BATCH * expected["bytes"], (world_size, sizes, grid)
        assert max(r["forward_messages"] for r in ffts) == expected["messages"], (world_size, sizes, grid)


@pytest.mark.timeout(120)
def test_failure_mid_pencil_transform_ends_every_rank():
    for message, seconds in spawn(pencil_failure, 4, (2, 2), timeout=100):
        assert "rank 3" in message and "pencil rank failed on purpose" in message, message
        assert seconds < 15, (message, seconds)  # the groups' timeout is 60 s: ended by the store poll, not by it


def test_grid_cost_counts_by_hand():
    # 4 x 4 x 6 mesh (4 k2 points) on a 2 x 2 grid: every block is 2 x 2 x 6 real, then 2 x 4 x 2 and 4 x 2 x 2 complex.
    # Each transpose sends one peer 2 x 2 x 2 complex numbers (128 bytes).
    assert grid_cost((4, 4, 6), (2, 2)) == {"held": 256, "messages": 2, "bytes": 256, "modelled": 2 * 65536 + 256}
    # 8^3 slabs on 4 ranks: 2 planes of 8 x 5 complex, 2 x 2 x 5 to each of 3 peers.
    assert grid_cost((8, 8, 8), (4, 1))["bytes"] == 3 * 20 * 16


def test_slab_or_pencil_rule():
    assert choose_grid((5, 7, 6), 8)[1] > 1  # more ranks than planes: pencils
    assert choose_grid((3, 40, 40), 4)[1] > 1
    assert choose_grid((64, 64, 64), 4) == (4, 1)  # few ranks, big mesh: the slab sends the fewest bytes
    assert choose_grid((32, 32, 32), 16) == (4, 4)  # many ranks, small mesh: 6 messages instead of 15
    assert choose_grid((32, 32, 32), 16, "slab") == (16, 1)
    assert choose_grid((64, 64, 64), 2, "pencil") == (1, 2)  # a prime number of ranks: one row
    assert choose_grid((64, 64, 64), 4, "pencil") == (2, 2)  # forced pencils are two-dimensional
    assert choose_grid((5, 7, 6), 1) == (1, 1)


def test_bad_grid_and_decomposition_are_clear_errors():
    with pytest.raises(ValueError, match="decomposition must be one of"):
        choose_grid((8, 8, 8), 4, "cubes")
    with pytest.raises(ValueError, match="grid \\(2, 1\\) must be two positive factors of the 1 ranks"):
        PencilMeshTransform(Comm(), (8, 8, 8), (2, 1))
    with pytest.raises(ValueError, match="parts must divide the ranks"):
        Comm().split([[0], [1]])


@pytest.mark.timeout(120)
def test_sub_communicators_talk_within_their_part():
    results = spawn(split_case, 4, timeout=100)
    for rank, r in enumerate(results):
        part = [rank % 2, rank % 2 + 2]  # this rank's part: [0, 2] or [1, 3]
        assert r["sub_rank"] == rank // 2, r
        assert r["sum"] == sum(part), r
        assert r["from_peer"] == 10 * part[1 - rank // 2], r
        assert r["broadcast"] == part[1], r
        # gather_rows to sub-rank 1 (world rank 2 or 3): rank a sends a + 1 rows of value a
        assert r["gathered"] == (None if rank < 2 else [float(a) for a in part for _ in range(a + 1)]), r
        # The part's traffic is counted on the parent: sub-rank 0 sent its rank + 1 rows of 2 float32 to the root.
        assert r["parent_counted"] == (0 if rank >= 2 else (rank + 1) * 2 * 4), r
        assert r["again_cached"], r
