"""Domains: owned atoms plus ghost images, the substrate of every local view.

A :class:`Domain` owns a set of atoms and knows, for each halo width ``w`` it
was prepared for, the ghost rows within ``w`` (plus a skin margin) of its
region: one *band* per width, ghost rows in band order, so that a narrower
halo is a prefix of a wider one (nested halos from one plan). ``ghost_rows(x_owned, w)`` produces the ghost rows of a per-atom tensor from
their owners, differentiably; ``fold_ghosts`` is its adjoint.

:class:`LocalDomain` is the single-process domain: one brick covering the
cell, ghosts are the periodic images of the atoms themselves. The distributed
domain (``halopipe.distributed.sharded``) implements the same interface with a
halo exchange between ranks, so pipelines and models run unchanged on both.

:class:`DomainConfig` says how a domain is built (skin, brick grid, halo
mode, timeout); a pipeline holds one and every domain it runs on must agree
with it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import numbers
import operator
from dataclasses import dataclass

import torch

from .geometry import Partition, images_near_bricks
from .meshfft import LocalMeshTransform, MeshTransform
from .neighbors import GroupedPairs, PairLists, max_displacement
from .sorting import stable_argsort

__all__ = [
    "Domain",
    "DomainConfig",
    "LocalDomain",
    "skin_margin",
    "next_plan_version",
    "DEFAULT_SKIN",
    "strain_displacement",
    "halo_widths",
    "band_index",
    "image_bands",
    "band_ends",
]

DEFAULT_SKIN = 1.0
"""Default neighbour-list skin, Å.

Molecular dynamics is the main use: with 1 Å a thermal atom (~0.01 Å/fs)
crosses skin/2 after tens of femtoseconds, so lists and halos are rebuilt
every few tens of steps instead of every step, while candidate pairs grow by
only ``((rc + 1) / rc)^3`` (1.4x at rc = 8 Å, 1.06x at 50 Å). Results do not
depend on it: pairs are always filtered at the exact cutoff.
"""

_plan_versions = itertools.count(1)


@dataclass
class DomainConfig:
    """How space is split and halos are built; the one owner of the skin.

    A :class:`~halopipe.Pipeline` holds one (``pipeline.config``); the
    single-process domain, the distributed one and the MD driver all take
    their skin from it.

    Parameters
    ----------
    grid : bricks per axis ``(px, py, pz)`` when decomposed; ``None`` picks the
        factorisation of the world size that minimises brick surface.
    skin : neighbour-list skin, Å (plans are reused until an atom moved
        skin/2); default :data:`DEFAULT_SKIN`.
    halo : ``"per_model"`` (each model gets the ghosts its own halo needs) or
        ``"max"`` (every model gets the widest halo, as LAMMPS hybrid/overlay
        does; for comparison and benchmarks).
    timeout : seconds a rank waits for its peers before failing.
    split_atoms : in a batch under a process group, a system with at least
        ``split_atoms`` atoms per rank is split in space over all ranks;
        smaller ones go whole to one rank each (:mod:`halopipe.batch`).
    """

    grid: tuple[int, int, int] | None = None
    skin: float = DEFAULT_SKIN
    halo: str = "per_model"
    timeout: float = 120.0
    split_atoms: int = 1000

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self, world_size: int | None = None) -> str | None:
        """What is wrong with this configuration (for ``world_size`` ranks, if given), if anything.

        Grid entries may be any integer type (numpy's included); a valid grid
        is stored as a tuple of Python ints.
        """
        if self.grid is not None:
            try:
                grid = tuple(operator.index(g) for g in self.grid if not isinstance(g, bool))
            except TypeError:
                grid = ()
            if len(grid) != 3 or len(tuple(self.grid)) != 3 or min(grid) < 1:
                return f"DomainConfig.grid must be three positive integers, got {self.grid!r}"
            if world_size is not None and math.prod(grid) != world_size:
                return (
                    f"DomainConfig.grid {grid} has {math.prod(grid)} bricks but the world size is {world_size}; "
                    f"use a grid whose product is {world_size} or grid=None"
                )
            self.grid = grid
        if not (isinstance(self.skin, numbers.Real) and math.isfinite(self.skin) and self.skin >= 0):
            return f"DomainConfig.skin must be a finite number >= 0 (Å), got {self.skin!r}"
        if self.halo not in ("per_model", "max"):
            return f"DomainConfig.halo must be 'per_model' or 'max', got {self.halo!r}"
        if not (isinstance(self.timeout, numbers.Real) and math.isfinite(self.timeout) and self.timeout > 0):
            return f"DomainConfig.timeout must be a finite number of seconds > 0, got {self.timeout!r}; a stalled peer must end the run"
        if isinstance(self.split_atoms, bool) or not isinstance(self.split_atoms, numbers.Integral) or self.split_atoms < 1:
            return f"DomainConfig.split_atoms must be a positive integer (atoms per rank), got {self.split_atoms!r}"
        return None


def holder_bit(ids: torch.Tensor) -> torch.Tensor:
    """A bit of each global id for the one-holder rule: the top bit of Knuth's 32-bit multiplicative hash of its low 31 bits.

    Atoms near each other get unrelated bits however ids run through space,
    so pairs across a face split about evenly between its two ranks (an id's
    parity alone split a lattice numbered along the face's normal 449 / 542).
    """
    return ((ids & 0x7FFFFFFF) * 2654435761 & 0xFFFFFFFF) >> 31  # below 2**63: no int64 overflow


def next_plan_version() -> int:
    """A plan identifier unique in this process.

    Caches of pairs and lists key on it: a counter per domain would repeat
    across domains (a new system, or the same one scattered again), and a
    cache keyed on it would hand one system's pairs to another.
    """
    return next(_plan_versions)


def skin_margin(skin: float) -> float:
    """Extra halo width that keeps a plan valid until some atom moves skin/2.

    An owned atom may sit skin/2 outside its brick (ownership hysteresis) and
    every atom may move skin/2 before the next rebuild, so ghosts are kept up
    to ``w + 1.5 * skin`` from the brick.
    """
    return 1.5 * float(skin)


def halo_widths(widths) -> tuple[float, ...]:
    """One halo width or several (Å) as the ascending distinct widths a plan nests (its bands)."""
    values = [widths] if isinstance(widths, numbers.Real) else list(widths)
    if not values:
        raise ValueError("a domain needs at least one halo width to plan for")
    return tuple(sorted({float(w) for w in values}))


def band_index(bands: tuple[float, ...], width: float) -> int:
    """The band of ``width`` among a plan's ``bands`` (:func:`halo_widths`); a width past the widest takes the widest."""
    width = float(width)
    if width in bands:
        return bands.index(width)
    if width >= bands[-1]:
        return len(bands) - 1
    raise ValueError(
        f"no ghost rows planned for a halo of {width} Å: the plan nests {list(bands)} Å; prepare the domain with every width its views use"
    )


def image_bands(distance: torch.Tensor, limits) -> torch.Tensor:
    """Each image's band: the narrowest of the ascending distance ``limits`` that holds it (the last for any beyond)."""
    if len(limits) == 1:
        return torch.zeros(distance.shape, dtype=torch.int64, device=distance.device)
    edges = torch.tensor(list(limits), dtype=distance.dtype, device=distance.device)
    return torch.searchsorted(edges, distance.contiguous()).clamp_(max=len(limits) - 1)


def band_ends(band: torch.Tensor, n_bands: int) -> tuple[int, ...]:
    """Rows within each band of rows in band order (``band``: each row's band): cumulative counts, one per band."""
    if n_bands == 1:
        return (int(band.numel()),)
    return tuple(torch.cumsum(torch.bincount(band, minlength=n_bands), 0).tolist())


def strain_displacement(ref_cell: torch.Tensor, cell: torch.Tensor, reach: float) -> tuple[float, torch.Tensor]:
    """How far a cell change since a plan's build counts as atom motion, and the affine map.

    A plan built at ``ref_cell`` holds pairs and ghosts up to ``reach`` Å
    (widest halo plus the skin margin). When the cell becomes ``cell`` every
    position maps affinely, ``r -> r @ M`` with ``M = ref_cell^-1 @ cell``,
    and a separation ``d <= reach`` changes length by at most
    ``e * reach`` with ``e = max(|s_max - 1|, |1 - s_min|)`` (``s``: the
    singular values of ``M``, the principal stretches). A separation can
    shrink by twice an atom's displacement, so this change counts as a
    displacement of ``e * reach / 2``; the plan stays valid while that plus
    the largest displacement beyond the affine one (``|r - r_ref @ M|``)
    is at most skin/2, the rule of the fixed cell.

    Returns
    -------
    (extra displacement in Å, ``M`` in float64)
    """
    mapping = torch.linalg.solve(ref_cell.detach().to(torch.float64), cell.detach().to(torch.float64))
    stretches = torch.linalg.svdvals(mapping)
    strain = max(float(stretches.max()) - 1.0, 1.0 - float(stretches.min()), 0.0)
    return 0.5 * strain * float(reach), mapping


class Domain:
    """Interface shared by the single-process and the distributed domains.

    Attributes
    ----------
    positions, numbers, masses, ids : owned atoms (ids are global indices).
    fields : per-atom tensors of the owned atoms.
    cell, pbc : global cell and periodicity.
    n_total : atoms in the whole system.
    skin : neighbour-list skin, Å.
    plan_version : identifies the current ghost plan, unique across all domains
        of the process (caches key on it); 0 before the first plan.
    owned_shift : (n_owned, 3) integer lattice shift that places each owned
        atom's row inside its brick (rows sit at ``r + owned_shift @ cell``).
    halo_bands : the halo widths the plan serves, ascending (:func:`halo_widths`).
    ghost_numbers, ghost_shift, ghost_ids, ghost_band : ghost rows at the
        widest planned width, in band order (each row's band: the narrowest
        of ``halo_bands`` it lies within); a ghost row sits at
        ``r_owner + ghost_shift @ cell``.
    """

    positions: torch.Tensor
    numbers: torch.Tensor
    masses: torch.Tensor
    ids: torch.Tensor
    fields: dict[str, torch.Tensor]
    cell: torch.Tensor
    pbc: torch.Tensor
    n_total: int
    skin: float
    plan_version: int
    owned_shift: torch.Tensor
    ghost_numbers: torch.Tensor
    ghost_shift: torch.Tensor
    ghost_ids: torch.Tensor
    ghost_band: torch.Tensor
    halo_bands: tuple[float, ...] = ()
    band_ends: tuple[int, ...] = ()
    """Ghost rows within each band (cumulative counts, one per band of :attr:`halo_bands`)."""
    _row_offsets: tuple | None = None  # (plan_version, cell, offsets of the owned rows and all ghosts) of :meth:`row_offsets`
    _pair_lists: PairLists | None = None  # this domain's candidate lists, per plan (:meth:`candidate_pairs`)
    _holder_keys: tuple | None = None  # (plan_version, keys of all the plan's rows) of :meth:`holder_keys`
    _row_labels: tuple | None = None  # (plan_version, numbers, ids of all the plan's rows) of :meth:`row_labels`
    system: torch.Tensor | None = None
    """Owned rows' system index in a batch (:class:`~halopipe.batch.BatchDomain`); None for one system."""
    n_systems: int = 1
    system_sizes: torch.Tensor | None = None  # (n_systems,) atoms per system of a batch

    @property
    def n_owned(self) -> int:
        return int(self.positions.shape[0])

    def ghost_count(self, width: float) -> int:
        """Number of ghost rows a model with halo ``width`` (one of :attr:`halo_bands`) sees."""
        return self.band_ends[band_index(self.halo_bands, width)]

    def band_limits(self, bands: tuple[float, ...]) -> tuple[float, ...]:
        """The distance limit of each band of ``bands``: its width plus the skin margin, and a hair for rounding."""
        return tuple(w + skin_margin(self.skin) + 1e-12 for w in bands)

    def row_offsets(self, cell: torch.Tensor, n_ghost: int) -> torch.Tensor:
        """``shift @ cell`` of the owned rows, then of the first ``n_ghost`` ghost rows: what places them.

        Kept for the current plan while the cell stays the same tensor value
        (an MD step reuses them), for all the plan's ghosts, so views of every
        width take a prefix; a cell that carries a graph (strain for stress)
        gets fresh, differentiable products.
        """
        rows = self.n_owned + n_ghost
        if cell.requires_grad:
            return torch.cat([self.owned_shift, self.ghost_shift[:n_ghost]]).to(cell.dtype) @ cell
        cached = self._row_offsets
        if cached is None or cached[0] != self.plan_version or not torch.equal(cached[1], cell):
            offsets = torch.cat([self.owned_shift, self.ghost_shift]).to(cell.dtype) @ cell
            cached = self._row_offsets = (self.plan_version, cell.detach().clone(), offsets)
        return cached[2][:rows]

    def placed_rows(self, positions: torch.Tensor, ghosts: torch.Tensor, cell: torch.Tensor) -> torch.Tensor:
        """A view's rows: the owned ``positions``, then the ``ghosts``' owner positions, each placed by its :meth:`row_offsets`.

        Differentiable in all three. One concatenation and one in-place add:
        two passes over the rows where shifting each part first took three.
        """
        return torch.cat([positions, ghosts]).add_(self.row_offsets(cell, ghosts.shape[0]))

    def row_labels(self, n_ghost: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Species and global ids of the owned rows and the first ``n_ghost`` ghost rows, made once per plan.

        Both stay the same until the plan changes (atoms migrate only with a
        new plan), so views of every step and width take a prefix instead of
        concatenating them again.
        """
        if self._row_labels is None or self._row_labels[0] != self.plan_version:
            numbers, ids = torch.cat([self.numbers, self.ghost_numbers]), torch.cat([self.ids, self.ghost_ids])
            self._row_labels = (self.plan_version, numbers, ids)
        rows = self.n_owned + n_ghost
        return self._row_labels[1][:rows], self._row_labels[2][:rows]

    def candidate_pairs(self, rows: torch.Tensor, n_ghost: int, cutoff: float, kind: str) -> GroupedPairs | torch.Tensor:
        """Owned-centred candidate pairs within ``cutoff + skin`` among ``rows``, once per plan.

        ``rows``: the owned rows, then ``n_ghost`` ghost rows (detached).
        ``kind`` (:data:`~halopipe.neighbors.LIST_KINDS`): ``"half"``, each
        pair once, grouped by owned row
        (:func:`~halopipe.neighbors.grouped_owned_half_pairs`);
        ``"one_holder"``, the half list less the pairs with a ghost that
        another holder evaluates, so that over all ranks each pair of the
        system is in exactly one list (LAMMPS's ``newton on``;
        :func:`~halopipe.neighbors.one_holder_pairs`, by :meth:`holder_keys`);
        ``"directed"``, ``(2, P)`` pairs in both directions from owned
        centres. Kept in this domain's
        :class:`~halopipe.neighbors.PairLists` until the plan changes; a
        model that pairs nothing (``cutoff <= 0``, D3's lattice sums) gets an
        empty list without a search.
        """
        if cutoff <= 0.0:
            if kind == "directed":
                return torch.zeros(2, 0, dtype=torch.int64, device=rows.device)
            return GroupedPairs.empty(self.n_owned, rows.device)
        if self._pair_lists is None:
            self._pair_lists = PairLists()
        reach = float(cutoff) + self.skin
        keys = (lambda: self.holder_keys(n_ghost)) if kind == "one_holder" else None
        return self._pair_lists.candidates(self.plan_version, rows, self.n_owned, n_ghost, reach, float(cutoff), kind, keys)

    def holder_keys(self, n_ghost: int) -> torch.Tensor:
        """(n_owned + n_ghost,) int64 keys that decide which holder keeps a pair with a ghost (:func:`.neighbors.one_holder_pairs`).

        ``4 id + 2 h`` for an owned row, ``h`` its id's :func:`holder_bit`.
        For a ghost that is a periodic image of an atom owned here
        (:meth:`own_images`), ``4 id + 2`` plus the sign of the first non-zero
        component of its lattice shift from that atom's row: of the two pairs
        ``(a, b + t)`` and ``(b, a - t)`` of owned atoms through their images,
        the one with the positive shift is kept. For a ghost owned by another
        rank (:meth:`foreign_ghosts`), ``4 id + 2 c`` with its class ``c``: its
        id's bit, flipped when this rank's number is below its owner's; an
        owned row whose bit differs from the class keeps the pair, and the
        owner, seeing the classes flipped, keeps exactly the others. Integers
        only, so every rank decides alike. Made once per plan for all its
        ghosts (a narrower view's keys are a prefix).
        """
        if self._holder_keys is None or self._holder_keys[0] != self.plan_version:
            self._holder_keys = (self.plan_version, self._make_holder_keys())
        return self._holder_keys[1][: self.n_owned + n_ghost]

    def _make_holder_keys(self) -> torch.Tensor:
        ids = torch.cat([self.ids, self.ghost_ids])
        keys = holder_bit(ids).mul_(2).add_(ids, alpha=4)
        ghost, owner = self.own_images()
        if ghost.numel():
            # index_select and in-place arithmetic: a third of the time of indexing and fresh temporaries (20,000 ghosts)
            sign = (self.ghost_shift.index_select(0, ghost) - self.owned_shift.index_select(0, owner)).sign_()
            # The sign of the first non-zero component: that of 4 s_0 + 2 s_1 + s_2 (each sign in {-1, 0, 1}).
            lead = sign[:, 0].mul(4).add_(sign[:, 1], alpha=2).add_(sign[:, 2]).sign_()
            rows = ghost + self.n_owned
            keys.index_copy_(0, rows, ids.index_select(0, rows).mul_(4).add_(lead).add_(2))
        foreign, below = self.foreign_ghosts()
        if foreign.numel():
            rows = foreign + self.n_owned
            keys.index_copy_(0, rows, keys.index_select(0, rows) ^ below.long().mul_(2))  # the class: the bit, flipped below the owner
        return keys

    def own_images(self) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - interface
        """``(ghost, owner)``: the ghosts (indices among the ghost rows) that are images of atoms owned here, and their owned rows."""
        raise NotImplementedError

    def foreign_ghosts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ghost, below)``: the ghosts owned by other ranks (indices among the ghost rows), and whether this rank is below their owner.

        "Below": this rank's number is the lower. None on one process, where
        every ghost is a periodic image of an atom owned here.
        """
        empty = torch.zeros(0, dtype=torch.int64, device=self.ghost_ids.device)
        return empty, empty.bool()

    def search_widest_lists(self, needs: set[tuple[int, float, str]], ghost_positions: torch.Tensor) -> None:
        """With lists of several ``(n_ghost, cutoff)`` of one kind to come, search once at the widest of both (per plan and kind).

        ``needs``: ``(n_ghost, cutoff, kind)`` of the half and one-holder
        lists the views will ask for. The narrower ones of a kind are then
        filtered from its widest by :meth:`candidate_pairs` instead of
        searched again. ``ghost_positions``: the owners' positions of the
        ghost rows, at least as many as the widest needs.
        """
        for kind in sorted({k for _, _, k in needs}):
            of_kind = [(n, c) for n, c, k in needs if k == kind]
            if len(of_kind) < 2:
                continue
            n_ghost, cutoff = max(n for n, _ in of_kind), max(c for _, c in of_kind)
            if self._pair_lists is not None and self._pair_lists.holds(self.plan_version, n_ghost, cutoff, kind):
                continue
            rows = self.placed_rows(self.positions.detach(), ghost_positions[:n_ghost], self.cell.detach())
            self.candidate_pairs(rows, n_ghost, cutoff, kind)

    def ghost_rows(self, x: torch.Tensor, width: float, known: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover
        """Ghost rows within ``width`` of a per-atom tensor, from their owners (differentiable).

        ``known``: the forward values if already fetched (then only the
        backward communicates).
        """
        raise NotImplementedError

    def fold_ghosts(self, x_ghost: torch.Tensor, width: float) -> torch.Tensor:  # pragma: no cover - interface
        """Each ghost row's value (of the ghost rows within ``width``) added to its owner's row.

        Differentiable: the adjoint of :meth:`ghost_rows`.
        """
        raise NotImplementedError

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Non-differentiable reduction over ranks (identity on one process)."""
        return x

    def mesh_transform(self, sizes, decomposition: str = "auto") -> MeshTransform:
        """The (possibly distributed) 3-D FFT of a mesh of ``sizes`` shared by this domain's processes.

        ``decomposition`` (``"auto"``, ``"slab"``, ``"pencil"``) chooses how ranks share it; one process holds it whole.
        """
        return LocalMeshTransform(sizes)

    def gather(self, x: torch.Tensor, root: int | None = None) -> torch.Tensor | None:
        """A per-atom tensor of the owned atoms -> all atoms in the original order.

        On every rank (``root=None``) or on rank ``root`` only (``None`` elsewhere).
        """
        full = x.new_zeros((self.n_total,) + tuple(x.shape[1:]))
        full[self.ids] = x.detach()
        return self.all_reduce(full)

    def agree(self, problem: str | None) -> None:
        """Raise ``problem`` (if any rank has one) on every rank, before any data moves."""
        if problem:
            raise ValueError(problem)

    def guard(self, what: str) -> contextlib.AbstractContextManager:
        """Context in which a failure on one rank becomes an error on all (nothing to do on one process)."""
        return contextlib.nullcontext()

    def problem(self, config: DomainConfig) -> str | None:
        """What keeps a pipeline with ``config`` from running on this domain, if anything."""
        if float(config.skin) != self.skin:
            return f"the pipeline's skin {config.skin} differs from the domain's skin {self.skin}; build the domain with pipeline.config"
        return None

    @property
    def n_exchanged(self) -> int:
        """Ghost rows held by the current plan (all widths)."""
        return int(self.ghost_band.shape[0])

    def prepare(self, widths, problem: str | None = None) -> bool:  # pragma: no cover - interface
        """Make the ghost plan valid for ``widths`` (one halo width or several: :func:`halo_widths`); returns True if it was rebuilt.

        A plan keeps the bands of earlier plans (it never narrows), so views
        of any width prepared for before stay valid.

        ``problem`` (this rank's, or None) is agreed first, as by :meth:`agree`,
        in the same collective.
        """
        raise NotImplementedError


class _IndexGather(torch.autograd.Function):
    """x[index] whose backward sums gradients into the indexed rows."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.n = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.n,) + grad.shape[1:])
        out.index_add_(0, index, grad)
        return out, None


class LocalDomain(Domain):
    """All atoms of a system in one process; ghosts are periodic images.

    Parameters
    ----------
    system : the :class:`~halopipe.System`.
    skin : neighbour-list skin, Å.
    """

    def __init__(self, system, skin: float = DEFAULT_SKIN) -> None:
        self.cell, self.pbc = system.cell, system.pbc
        self.positions = system.positions
        self.numbers, self.masses = system.numbers, system.masses
        self.fields = dict(system.fields)
        self.ids = torch.arange(system.n_atoms, device=system.device)
        self.n_total = system.n_atoms
        self.skin = float(skin)
        self.plan_version = 0
        self._ref: torch.Tensor | None = None

    def update(self, system) -> None:
        """Take new positions/fields of the same atoms (plan kept if still valid)."""
        self.positions = system.positions
        self.fields = dict(system.fields)
        self.masses = system.masses
        if not torch.equal(self.cell, system.cell):
            self.cell = system.cell
            self._ref = None

    def compatible(self, system) -> bool:
        return (
            system.n_atoms == self.n_total
            and torch.equal(system.numbers, self.numbers)
            and torch.equal(system.pbc, self.pbc)
            and system.dtype == self.positions.dtype
            and system.device == self.positions.device
        )

    def prepare(self, widths, problem: str | None = None) -> bool:
        self.agree(problem)
        widths = halo_widths(widths)
        stale = (
            self._ref is None
            or not set(widths) <= set(self.halo_bands)
            or max_displacement(self.positions, self._ref) > (0.5 * self.skin if self.skin > 0 else 0.0)
        )
        if not stale:
            return False
        self._build(halo_widths(self.halo_bands + widths))
        return True

    def _build(self, bands: tuple[float, ...]) -> None:
        partition = Partition.build((1, 1, 1), self.cell, self.pbc)
        frac = partition.geometry.fractional(self.positions)
        wrapped, image = partition.wrap(frac)
        own = torch.zeros(self.n_owned, dtype=torch.int64, device=self.positions.device)
        imgs = images_near_bricks(partition, wrapped, image, bands[-1] + skin_margin(self.skin), own_rank=own)
        self.owned_shift = -image
        self.ghost_band = image_bands(imgs.distance, self.band_limits(bands))
        if len(bands) == 1:  # one band: the images in their own order (the owned rows')
            self.ghost_atom, self.ghost_shift = imgs.atom, imgs.shift
        else:
            order = stable_argsort(self.ghost_band)
            # index_select: about half the time of indexing by a tensor on the CPU
            self.ghost_atom, self.ghost_shift = imgs.atom.index_select(0, order), imgs.shift.index_select(0, order)
            self.ghost_band = self.ghost_band.index_select(0, order)
        self.halo_bands = bands
        self.band_ends = band_ends(self.ghost_band, len(bands))
        self.ghost_numbers = self.numbers.index_select(0, self.ghost_atom)
        self.ghost_ids = self.ids.index_select(0, self.ghost_atom)
        self._ref = self.positions.detach().clone()
        self.plan_version = next_plan_version()

    def ghost_rows(self, x: torch.Tensor, width: float, known: torch.Tensor | None = None) -> torch.Tensor:
        return _IndexGather.apply(x, self.ghost_atom[: self.ghost_count(width)])  # a local gather: nothing to save

    def fold_ghosts(self, x_ghost: torch.Tensor, width: float) -> torch.Tensor:
        out = x_ghost.new_zeros((self.n_owned,) + x_ghost.shape[1:])
        return out.index_add(0, self.ghost_atom[: x_ghost.shape[0]], x_ghost)  # differentiable: its backward gathers

    def own_images(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(self.ghost_atom.numel(), device=self.ghost_atom.device), self.ghost_atom  # every ghost
