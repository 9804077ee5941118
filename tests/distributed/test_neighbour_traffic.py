"""A rank talks to its neighbours only: per-rank messages do not grow with the rank count.

A chain of argon bricks along x (10.52 Å each, LJ 5 Å, skin 1 Å): a plan's
peers lie within 7 Å of a brick, so each rank's peers are its two neighbours
along the chain on 4 ranks and on 8 alike. A step and a rebuild with
migration must then send the same number of messages per rank on both. An
atom that jumps past the neighbours must still arrive at its new owner, with
results equal to one process.
"""

import pytest

from halopipe.distributed.launch import spawn

from ._traffic_workers import A, far_jump, neighbour_traffic


@pytest.mark.timeout(300)
def test_messages_per_rank_do_not_grow_with_the_rank_count():
    runs = {p: spawn(neighbour_traffic, p, p, timeout=280) for p in (4, 8)}
    for p, results in runs.items():
        for r in results:
            # Hand-counted neighbours on a ring of p bricks; no all-to-all (the old count exchange was one).
            assert r["peers"] == sorted({(r["rank"] - 1) % p, (r["rank"] + 1) % p}), (p, r)
            assert r["all_to_alls"] == 0, (p, r)
            assert r["step"]["rebuilt"] == 0 and r["rebuild"]["rebuilt"] == 1, (p, r)
            assert r["rebuild"]["migrated"], (p, r)  # the plane near each upper face moved to the next rank
    for phase in ("step", "rebuild"):
        messages = {p: max(r[phase]["messages"] for r in results) for p, results in runs.items()}
        sent = {p: max(r[phase]["bytes"] for r in results) for p, results in runs.items()}
        assert messages[4] == messages[8] > 0, (phase, messages)
        assert 0.9 * sent[4] <= sent[8] <= 1.1 * sent[4], (phase, sent)  # the same bricks, up to the atoms' noise


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "jump, far",
    [
        (2.5 * A, True),  # brick 3 -> brick 1 (not a neighbour), onto an octahedral site
        (0.5 * A, False),  # brick 3 -> brick 0, a neighbour: still point to point
    ],
)
def test_an_atom_that_jumps_far_reaches_its_new_owner_exactly(jump, far):
    # Atom 0 starts at x = -0.3 Å, in brick 3 of the periodic chain of 4.
    r = spawn(far_jump, 4, 4, 0, jump, timeout=280)[0]
    assert r["owner"] == (1 if far else 0), r
    assert r["owned_once"], r
    assert r["energy_rel"] < 1e-12 and r["force"] < 1e-10 and r["stress"] < 1e-10, r
    assert (r["all_to_alls"] > 0) == far, r  # only a jump past the neighbours takes the all-to-all path
