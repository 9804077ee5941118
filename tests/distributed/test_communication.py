import pytest

from halopipe.distributed.launch import spawn

from ._lifetime_workers import many_scatters
from ._workers import autograd_collectives, comm_volume, failure, halo_rows_of_every_shape


@pytest.mark.timeout(200)
def test_refresh_sends_only_the_rows_it_serves_and_per_model_halos_are_smaller():
    results = spawn(comm_volume, 4, (2, 2, 1), timeout=180)
    for r in results:
        for halo in ("per_model", "max"):
            assert r[halo + "_ratio"] <= 1.5
            assert r[halo + "_ratio"] >= 1.0
            # A refresh at a narrower width moves only the rows within that width.
            assert 0 < r[halo + "_short_bytes"] < r[halo + "_wide_bytes"]
        assert r["per_model"]["LennardJones"] < r["max"]["LennardJones"]
        assert r["per_model"]["DSFCoulomb"] == r["max"]["DSFCoulomb"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("model, refreshes", [("lj", 0), ("dsf", 1)])
def test_autograd_pair_models_exchange_nothing_for_their_ghost_energy_shares(model, refreshes):
    """Hand-counted collectives of an autograd pair model's evaluation on 2 ranks, with the plan unchanged.

    Forces only: the plan check's reduction, the ghost positions out, the
    model's input fields out (``refreshes``: DSF's static charges, whose
    gradient is not asked for) and the position gradients home. Energies add
    the ghost rows' energy shares going home for the per-atom energies, and
    the reduction of the totals. Folding the shares in the graph cost two
    exchanges more on every evaluation (the fold and its backward).
    """
    for r in spawn(autograd_collectives, 2, model, timeout=180):
        assert r["rebuilds"] == 1, r  # the counted evaluations reuse the first one's plan
        assert r["counts"]["forces"] == {"exchange": 2 + refreshes, "all_reduce": 1}, r
        assert r["counts"]["energy"] == {"exchange": 3 + refreshes, "all_reduce": 2}, r


@pytest.mark.timeout(120)
def test_exception_on_one_rank_ends_every_rank_with_its_cause():
    messages = spawn(failure, 3, "exception", timeout=100)
    for m in messages:
        assert "rank 1" in m and "model exploded on purpose" in m, m
        seconds = float(m.rsplit("after ", 1)[1].split(" s]")[0])
        assert seconds < 15, m  # configured timeout 5 s, plus the time to read the store


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("nan", ["rank 1", "non-finite position"]),
        ("grid", ["grid (3, 1, 1)", "world size is 2"]),
        ("wrong_rank", ["rank 1", "only the source rank 0"]),
    ],
)
def test_bad_input_is_rejected_on_every_rank(kind, expected):
    messages = spawn(failure, 2, kind, timeout=100)
    for m in messages:
        assert all(e in m for e in expected), m
        seconds = float(m.rsplit("after ", 1)[1].split(" s]")[0])
        assert seconds < 5, m  # rejected before any data moved, not by a timeout


@pytest.mark.timeout(300)
def test_many_scatters_reuse_one_process_group():
    """500 scatters on 2 ranks: descriptors and threads stay bounded (each used to leak a process group)."""
    for r in spawn(many_scatters, 2, 500, timeout=280):
        fds_first, fds_last = r["fds"]
        threads_first, threads_last = r["threads"]
        assert fds_last <= fds_first + 4, r
        assert threads_last <= threads_first + 1, r


@pytest.mark.timeout(200)
@pytest.mark.parametrize("nproc, shared_memory", [(1, True), (2, True), (3, True), (2, False)])
def test_refresh_and_fold_move_rows_of_any_shape_to_and_from_their_owners(nproc, shared_memory):
    """Ghost rows of 1-D, (3,), (4,) and (2, 3) rows are their owners' rows, and a fold sums them home (ids as the reference).

    At two nested widths (two bands of one plan); the narrower band holds the ghosts of a plan for its width alone.
    Through shared memory the rows are gathered into the mailboxes and read where they lie; through gloo (shared
    memory off) they are copied.
    """
    results = spawn(halo_rows_of_every_shape, nproc, 6.0, shared_memory, timeout=180)
    assert sum(r["ghosts"] for r in results) > 0
    for r in results:
        assert r["refresh"] and r["fold"] and r["band_is_its_own_plan"], r
        assert r["shared_memory"] == (shared_memory and nproc > 1), r
