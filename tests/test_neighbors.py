import itertools

import numpy as np
import pytest
import torch

from halopipe import neighbors
from halopipe.kernels import pairs as pair_kernels
from halopipe.neighbors import VerletList, neighbor_list, owned_pairs, owned_pairs_cell_list


def brute_force(pos, cell, pbc, cutoff, reach=4):
    """Every (i, j, shift) with 0 < |r_j + S cell - r_i| <= cutoff, by enumeration."""
    ranges = [range(-reach, reach + 1) if p else range(1) for p in pbc]
    out = set()
    for s in itertools.product(*ranges):
        d = pos[None, :, :] + np.array(s) @ cell - pos[:, None, :]
        r = np.linalg.norm(d, axis=2)
        for i, j in zip(*np.nonzero((r <= cutoff) & (r > 0))):
            out.add((int(i), int(j), s))
    return out


CELLS = {
    "triclinic": np.array([[6.0, 0, 0], [1.5, 5.5, 0], [0.7, 1.1, 5.2]]),
    "cubic": np.eye(3) * 7.0,
}


@pytest.mark.parametrize("cell_name", list(CELLS))
@pytest.mark.parametrize("cutoff", [2.5, 4.0, 9.0])  # below half box, above half box, above the box
@pytest.mark.parametrize("pbc", [(True, True, True), (True, False, True)])
def test_periodic_list_matches_brute_force(cell_name, cutoff, pbc):
    cell = CELLS[cell_name]
    rng = np.random.default_rng(1)
    pos = rng.uniform(0, 1, (12, 3)) @ cell
    i, j, s = neighbor_list(torch.tensor(pos), torch.tensor(cell), torch.tensor(pbc), cutoff)
    got = {(int(a), int(b), tuple(int(x) for x in c)) for a, b, c in zip(i, j, s)}
    assert got == brute_force(pos, cell, pbc, cutoff)


@pytest.mark.parametrize("n_owned", [15, 4])  # vesin path, and the owned-centred cell list (rows > 8 x owned)
def test_owned_pairs_on_explicit_rows(n_owned):
    rng = np.random.default_rng(2)
    rows = torch.tensor(rng.uniform(0, 8, (40, 3)))
    pairs = owned_pairs(rows, n_owned, 3.0)
    r = torch.cdist(rows, rows)
    r.fill_diagonal_(float("inf"))  # cdist can leave rounding noise on the diagonal
    want = {(int(a), int(b)) for a, b in zip(*torch.nonzero(r <= 3.0, as_tuple=True)) if a < n_owned}
    assert {(int(a), int(b)) for a, b in pairs.T} == want


def test_verlet_list_reuses_within_half_skin_and_stays_exact():
    cell = torch.tensor(CELLS["triclinic"])
    pbc = torch.tensor([True, True, True])
    rng = np.random.default_rng(3)
    pos = torch.tensor(rng.uniform(0, 1, (30, 3))) @ cell
    vl = VerletList(cutoff=3.0, skin=1.0)
    vl(pos, cell, pbc)
    for _step in range(6):
        pos = pos + torch.tensor(rng.normal(scale=0.05, size=(30, 3)))
        i, j, s = vl(pos, cell, pbc)
        got = {(int(a), int(b), tuple(int(x) for x in c)) for a, b, c in zip(i, j, s)}
        assert got == brute_force(pos.numpy(), cell.numpy(), (True, True, True), 3.0)
    assert vl.builds < 7  # at least one step reused the list
    big = pos + 0.6
    big[0] += 0.0
    assert not vl.needs_rebuild(pos, cell)
    moved = pos.clone()
    moved[0, 0] += 0.6
    assert vl.needs_rebuild(moved, cell)


def test_bad_cutoff():
    with pytest.raises(ValueError, match="cutoff must be positive"):
        neighbor_list(torch.zeros(2, 3), torch.eye(3), torch.tensor([True] * 3), 0.0)


def test_cell_list_equals_vesin_search():
    rng = np.random.default_rng(5)
    rows = torch.tensor(rng.uniform(-3, 11, (300, 3)))
    a = owned_pairs_cell_list(rows, 100, 2.7, max_candidates=500)  # small chunks exercise the chunking
    b = owned_pairs(rows, 100, 2.7)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kernels", ["warp", "torch"])
@pytest.mark.parametrize(
    "layout",
    # rows ~ owned; rows >> owned (D3-like halo); a few rows far apart (coarser cubes); a lattice with many pairs exactly at
    # the cutoff and rows on cube faces (the search trims its scan to the cutoff sphere: rounding must never drop one);
    # hundreds of rows a cutoff sphere (the Warp search bins by cubes of half the cutoff)
    ["dense", "wide_halo", "sparse", "lattice", "crowded"],
)
def test_owned_half_pairs_match_brute_force(kernels, layout, monkeypatch):
    """The owned-centred search (Warp cell list, or vesin / torch cell list) against all distances by cdist."""
    from halopipe.kernels import backend, pairs
    from halopipe.neighbors import owned_half_pairs

    monkeypatch.setenv("HALOPIPE_KERNELS", kernels)
    backend.warp_module.cache_clear()
    pairs.warp_kernel.cache_clear()
    rng = np.random.default_rng(7)
    if layout == "dense":
        rows, n_owned, cutoff = rng.uniform(-2, 12, (400, 3)), 150, 3.1
    elif layout == "wide_halo":
        rows, n_owned, cutoff = rng.uniform(-10, 20, (900, 3)), 40, 6.0
    elif layout == "crowded":
        rows, n_owned, cutoff = rng.uniform(0, 7, (700, 3)), 100, 3.8
        density = 700 / 7.0**3
        assert density * 4.0 / 3.0 * np.pi * cutoff**3 > neighbors.SPHERE_ROWS_FOR_HALF_CUBES
        assert neighbors._cube_edge(cutoff, density) < cutoff
    elif layout == "lattice":
        grid = np.stack(np.meshgrid(*[np.arange(8.0)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
        rows, n_owned, cutoff = grid[rng.permutation(len(grid))], 200, 2.0 + 1e-12  # ties at 2 included beyond rounding
    else:
        centres = rng.uniform(0, 1, (10, 3)) * np.array([2000.0, 200.0, 3.0])  # clusters of 3 far apart
        rows, n_owned, cutoff = np.repeat(centres, 3, axis=0) + rng.uniform(-1, 1, (30, 3)), 10, 2.5
    rows = torch.tensor(rows)
    got = owned_half_pairs(rows, n_owned, cutoff)
    r = torch.cdist(rows, rows)
    i, j = torch.nonzero(r <= cutoff, as_tuple=True)
    want = {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}
    assert bool((got[0] < n_owned).all())
    assert {(min(a, b), max(a, b)) for a, b in got.T.tolist()} == want
    assert got.shape[1] == len(want)  # each pair once
    backend.warp_module.cache_clear()
    pairs.warp_kernel.cache_clear()


@pytest.mark.parametrize("search", ["packed", "packed_past_its_buffer", "slots", "a_row_overflows_its_slots", "two_passes"])
def test_every_path_of_the_warp_search_gives_the_pairs_grouped_by_owned_row(search, monkeypatch):
    """Every path, against cdist: one pass packed in order (the CPU), and its fallback when the pairs outnumber its
    buffer; one pass into per-row slots (a GPU), and its fallback when a row has more partners than slots; two passes."""

    if search in ("slots", "a_row_overflows_its_slots"):
        monkeypatch.setattr(pair_kernels, "PACK_IN_ORDER", False)
    if search in ("packed_past_its_buffer", "a_row_overflows_its_slots"):
        monkeypatch.setattr(neighbors, "_slot_capacity", lambda *args: 3)
    elif search == "two_passes":
        monkeypatch.setattr(neighbors, "PAIR_SLOT_BYTES", 0)
    rows, n_owned, cutoff = torch.tensor(np.random.default_rng(11).uniform(-2, 12, (400, 3))), 150, 3.1
    grouped = neighbors.grouped_owned_half_pairs(rows, n_owned, cutoff)
    got, start = grouped.pairs, grouped.start
    assert grouped.partners.dtype == start.dtype == torch.int32 and torch.equal(grouped.partners.long(), got[1])
    r = torch.cdist(rows, rows)
    i, j = torch.nonzero(r <= cutoff, as_tuple=True)
    want = {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}
    assert {(min(a, b), max(a, b)) for a, b in got.T.tolist()} == want and got.shape[1] == len(want)
    assert bool((got[0][1:] >= got[0][:-1]).all())  # grouped by owned row, with its offsets
    assert torch.equal(start[1:].long(), torch.cumsum(torch.bincount(got[0], minlength=n_owned), 0))


def _brute_force_half_pairs(rows: torch.Tensor, n_owned: int, cutoff: float) -> set[tuple[int, int]]:
    i, j = torch.nonzero(torch.cdist(rows, rows) <= cutoff, as_tuple=True)
    return {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}


def test_a_kept_list_is_never_written_over_by_later_searches_and_its_memory_serves_one_once_it_is_gone():
    """The CPU search's list is a view of a buffer its pool lends: a later search on other rows must not write into a
    list still held, and once the list is dropped, a search writes into its memory again (no fresh pages)."""
    from halopipe.scratch import ScratchPool

    assert pair_kernels.packs_in_order(torch.device("cpu")) and pair_kernels.warp_kernel("owned_half_packed", neighbors._LISTS) is not None
    pool, rng = ScratchPool(keep=2), np.random.default_rng(5)
    rows = [torch.tensor(rng.uniform(-2, 12, (400, 3))) for _ in range(3)]
    held = neighbors.grouped_owned_half_pairs(rows[0], 150, 3.1, pool=pool)
    want = _brute_force_half_pairs(rows[0], 150, 3.1)
    address = held.partners.data_ptr()
    second = neighbors.grouped_owned_half_pairs(rows[1], 150, 3.1, pool=pool)
    assert second.partners.data_ptr() != address
    assert {(min(a, b), max(a, b)) for a, b in held.pairs.T.tolist()} == want  # still the first rows' pairs
    del held
    third = neighbors.grouped_owned_half_pairs(rows[2], 150, 3.1, pool=pool)
    assert third.partners.data_ptr() == address
    assert {(min(a, b), max(a, b)) for a, b in third.pairs.T.tolist()} == _brute_force_half_pairs(rows[2], 150, 3.1)
    assert {(min(a, b), max(a, b)) for a, b in second.pairs.T.tolist()} == _brute_force_half_pairs(rows[1], 150, 3.1)


def _view_rows(domain, width: float) -> torch.Tensor:
    """Owned rows then the ghost rows within ``width``, as a view builds them."""
    pos, cell = domain.positions, domain.cell
    ghosts = pos[domain.ghost_atom[: domain.ghost_count(width)]] + domain.ghost_shift[: domain.ghost_count(width)].to(pos.dtype) @ cell
    return torch.cat([pos + domain.owned_shift.to(pos.dtype) @ cell, ghosts])


@pytest.mark.parametrize("kernels", ["warp", "warp_slots", "warp_two_passes", "torch"])
def test_narrower_half_list_equals_a_fresh_search(kernels, monkeypatch):
    """A list filtered from a wider one (more ghosts, longer cutoff) holds exactly the pairs of a direct search at the narrower one.

    Warp filters in one pass, packed in order on the CPU, or into the wider
    list's layout as on a GPU (``warp_slots``), or in two passes where that
    layout would not fit (``warp_two_passes``: no room at all).
    """
    from halopipe import System
    from halopipe.domain import LocalDomain
    from halopipe.kernels import backend, pairs
    from halopipe.neighbors import grouped_owned_half_pairs, narrower_half_pairs

    if kernels == "warp_two_passes":
        monkeypatch.setattr(neighbors, "PAIR_SLOT_BYTES", 0)
    elif kernels == "warp_slots":  # a GPU's one pass into slots, then packed
        monkeypatch.setattr(pair_kernels, "PACK_IN_ORDER", False)
    monkeypatch.setenv("HALOPIPE_KERNELS", kernels.removesuffix("_two_passes").removesuffix("_slots"))
    backend.warp_module.cache_clear()
    pairs.warp_kernel.cache_clear()
    cell = np.array([[9.0, 0.0, 0.0], [2.3, 8.1, 0.0], [-1.4, 1.9, 7.6]])  # irregular triclinic, shorter than the cutoffs
    rng = np.random.default_rng(11)
    positions = rng.uniform(0, 1, (120, 3)) @ cell
    numbers = torch.full((120,), 18)
    system = System(positions=torch.tensor(positions), numbers=numbers, cell=torch.tensor(cell), pbc=torch.tensor([True] * 3))
    domain = LocalDomain(system, skin=0.5)
    domain.prepare([6.5, 4.0, 3.5, 0.5])  # a band of ghost rows per width below, each a prefix of the next
    n_owned = domain.n_owned
    wide_rows = _view_rows(domain, 6.5)
    wide_list = grouped_owned_half_pairs(wide_rows, n_owned, 7.0)
    wide, start = wide_list.pairs, wide_list.start
    # grouped by owned row whichever search ran (the torch paths sort), with offsets a bincount agrees with
    assert bool((wide[0, 1:] >= wide[0, :-1]).all())
    assert torch.equal(start[1:].long(), torch.cumsum(torch.bincount(wide[0], minlength=n_owned), 0))
    for width, reach in [(6.5, 5.2), (4.0, 7.0), (3.5, 4.0), (0.5, 1.5)]:  # fewer ghosts and/or a shorter cutoff
        rows = _view_rows(domain, width)
        narrower = narrower_half_pairs(wide_list, rows, reach)
        got, got_start = narrower.pairs, narrower.start
        r = torch.cdist(rows, rows)
        i, j = torch.nonzero(r <= reach, as_tuple=True)
        want = {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}
        assert 0 < len(want) < wide.shape[1]
        assert {(min(a, b), max(a, b)) for a, b in got.T.tolist()} == want
        assert got.shape[1] == len(want) and bool((got[0] < n_owned).all())
        # the same pairs as a fresh search (which end of an owned pair comes first depends on the search's cubes)
        fresh = grouped_owned_half_pairs(rows, n_owned, reach).pairs
        assert {(min(a, b), max(a, b)) for a, b in got.T.tolist()} == {(min(a, b), max(a, b)) for a, b in fresh.T.tolist()}
        assert fresh.shape[1] == got.shape[1]
        # still grouped by owned row, with offsets a bincount agrees with
        assert bool((got[0, 1:] >= got[0, :-1]).all())
        offsets = torch.cumsum(torch.bincount(got[0], minlength=n_owned), 0)
        assert torch.equal(got_start[1:].long(), offsets) and int(got_start[0]) == 0
    backend.warp_module.cache_clear()
    pairs.warp_kernel.cache_clear()


def test_grouped_pairs_hold_the_pairs_their_offsets_imply():
    """A list grouped from shuffled pairs: offsets by a bincount, partners in each row's order, (2, P) made back exactly."""
    from halopipe.neighbors import GroupedPairs

    rng = np.random.default_rng(3)
    first = torch.tensor(rng.integers(0, 6, 40))
    pairs = torch.stack([first, torch.tensor(rng.integers(6, 30, 40))])
    grouped = GroupedPairs.from_pairs(pairs, 7)  # row 6 has no pairs
    want = sorted(range(40), key=lambda k: (int(first[k]), k))  # by owned row, each row's pairs in their given order
    assert torch.equal(grouped.pairs, pairs[:, want])
    assert torch.equal(grouped.start[1:].long(), torch.cumsum(torch.bincount(first, minlength=7), 0)) and int(grouped.start[0]) == 0
    remade = GroupedPairs(grouped.partners, grouped.start)  # only the int32 form: (2, P) from the offsets
    assert remade.partners.dtype == torch.int32 and torch.equal(remade.pairs, pairs[:, want]) and remade.n_owned == 7
    empty = GroupedPairs.empty(4, "cpu")
    assert empty.n_pairs == 0 and empty.pairs.shape == (2, 0) and empty.start.tolist() == [0] * 5


def test_a_views_grouped_list_is_made_into_int64_pairs_only_when_a_model_reads_them():
    """Lennard-Jones reads the int32 grouped list as it is; `pairs` on the view (or a replaced view) gives the (2, P) list."""
    from halopipe import LennardJones, System
    from halopipe.domain import LocalDomain
    from halopipe.pipeline import Step, build_view

    rng = np.random.default_rng(5)
    cell = torch.eye(3, dtype=torch.float64) * 12.0
    positions = torch.tensor(rng.uniform(0, 12, (60, 3)))
    system = System(positions=positions, numbers=torch.full((60,), 18), cell=cell, pbc=torch.tensor([True] * 3))
    model = LennardJones(0.01, 3.4, 5.0)
    domain = LocalDomain(system, skin=0.5)
    domain.prepare(model.halo)
    view = build_view(domain, Step(model), model.halo, system.positions, cell, {})
    grouped = view.half_pairs
    assert grouped is not None and view.pair_offsets is grouped.start
    model(view, direct=True)
    assert "pairs" not in grouped.__dict__  # the kernel never needed the (2, P) int64 list
    assert view.replace(need_energy=False).half_pairs is grouped
    r = torch.cdist(view.positions, view.positions)
    i, j = torch.nonzero(r <= 5.5, as_tuple=True)
    want = {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < domain.n_owned}
    assert {(min(a, b), max(a, b)) for a, b in view.pairs.T.tolist()} == want and view.pairs.shape[1] == len(want)


@pytest.mark.parametrize("slices", [1, 3, 8])
def test_the_search_finds_every_pair_whatever_the_x_slices_of_its_cells(slices, monkeypatch):
    """Cells of 1, 3 or 8 x slices per cutoff (the scan trimmed slice by slice): a lattice with ties at the cutoff, against cdist."""

    monkeypatch.setattr(neighbors, "X_SLICES_PER_CUTOFF", slices)
    rng = np.random.default_rng(13)
    grid = np.stack(np.meshgrid(*[np.arange(9.0)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    for rows, n_owned, cutoff in [
        (torch.tensor(grid[rng.permutation(len(grid))] * 0.75), 300, 1.5 + 1e-12),  # rows on cell faces, pairs at the cutoff
        (torch.tensor(rng.uniform(-2, 12, (500, 3))), 200, 3.1),
    ]:
        got = neighbors.grouped_owned_half_pairs(rows, n_owned, cutoff).pairs
        i, j = torch.nonzero(torch.cdist(rows, rows) <= cutoff, as_tuple=True)
        want = {(int(a), int(b)) for a, b in zip(i, j) if a < b and a < n_owned}
        assert {(min(a, b), max(a, b)) for a, b in got.T.tolist()} == want and got.shape[1] == len(want)


def _canonical_pairs(view, pairs: torch.Tensor, positions: np.ndarray, cell: np.ndarray, first_id: int) -> list:
    """``(i, j, S)`` of each view pair between atoms ``i`` and ``j + S @ cell`` of one system, the smaller of its two directions."""
    rows = view.positions.detach().numpy()
    a, b = pairs.numpy()
    i, j = view.ids[a].numpy() - first_id, view.ids[b].numpy() - first_id
    shift = np.rint((rows[b] - rows[a] - (positions[j] - positions[i])) @ np.linalg.inv(cell)).astype(int)
    return [min((int(p), int(q), tuple(s.tolist())), (int(q), int(p), tuple((-s).tolist()))) for p, q, s in zip(i, j, shift)]


@pytest.mark.parametrize("half_first", [False, True], ids=["searched", "filtered"])
@pytest.mark.parametrize("kernels", ["warp", "warp_slots", "warp_two_passes", "torch"])
def test_one_holder_lists_hold_each_pair_of_the_system_once(kernels, half_first, monkeypatch):
    """Over a batch's systems and their periodic images, each pair within the list's reach is in exactly one one-holder list.

    Against enumerated lattice images: a small triclinic cell (the reach
    spans several images of an atom, itself included) and a cubic one in one
    batch, so ids are batch rows and shifts come from each system's cell; at
    two cutoffs, the narrower list made from the wider one-holder list. The
    wider list is searched with the rule in the search, or (``half_first``:
    the view's whole half list read first) filtered from the half list.
    Warp's searches and filters run in one pass (packed in order on the CPU,
    or into slots as on a GPU: ``warp_slots``), or in two (``warp_two_passes``).
    """
    from halopipe import Batch, LennardJones, System
    from halopipe.batch import BatchDomain
    from halopipe.kernels import backend, pairs
    from halopipe.pipeline import Step, build_view

    if kernels == "warp_two_passes":
        monkeypatch.setattr(neighbors, "PAIR_SLOT_BYTES", 0)
    elif kernels == "warp_slots":  # a GPU's one pass into slots, then packed
        monkeypatch.setattr(pair_kernels, "PACK_IN_ORDER", False)
    monkeypatch.setenv("HALOPIPE_KERNELS", kernels.removesuffix("_two_passes").removesuffix("_slots"))
    backend.warp_module.cache_clear()
    pairs.warp_kernel.cache_clear()
    rng = np.random.default_rng(8)
    systems = []
    for cell, n in ((CELLS["triclinic"], 10), (CELLS["cubic"] * 1.6, 70)):
        positions = rng.uniform(0, 1, (n, 3)) @ cell
        pbc = torch.tensor([True] * 3)
        systems.append(System(positions=torch.tensor(positions), numbers=torch.full((n,), 18), cell=torch.tensor(cell), pbc=pbc))
    skin = 0.5
    domain = BatchDomain(Batch(systems), skin=skin)
    domain.prepare([6.0, 4.0])  # a band per cutoff below
    for cutoff in (6.0, 4.0):  # the narrower list is filtered from the wider one-holder list
        model = LennardJones(0.01, 3.0, cutoff=cutoff)
        view = build_view(domain, Step(model), model.halo, domain.positions, domain.cell, {})
        half = view.half_pairs if half_first else None
        once = view.one_holder_pairs
        half = half or view.half_pairs
        assert once is view.one_holder_pairs and once.n_pairs < half.n_pairs  # kept per plan; some pairs were held twice
        first_id = 0
        for b, system in enumerate(systems):
            pos, cell = system.positions.numpy(), system.cell.numpy()
            mine = once.pairs[:, view.system[once.pairs[0]] == b]
            got = _canonical_pairs(view, mine, pos, cell, first_id)
            want = {min(p, (p[1], p[0], tuple(-x for x in p[2]))) for p in brute_force(pos, cell, (True,) * 3, cutoff + skin)}
            assert len(got) == len(set(got)), "a pair is listed twice"
            assert set(got) == want
            first_id += system.n_atoms
    backend.warp_module.cache_clear()
    pairs.warp_kernel.cache_clear()
