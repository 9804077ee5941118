"""A system split over ranks: each rank owns the atoms of one brick.

:meth:`ShardedSystem.scatter` distributes a :class:`~halopipe.System` held by
one rank. Afterwards each rank holds only its owned atoms (positions, species,
masses, global ``ids`` and every per-atom field) and, once a pipeline asks for
it, a halo plan. Plans are rebuilt only when some atom moved more than skin/2
since the last build (decided globally, so all ranks rebuild together); at a
rebuild atoms that left their brick by more than skin/2 migrate to their new
owner (the skin/2 hysteresis keeps boundary atoms from flipping every step).

A rebuild talks to neighbouring ranks only. After a migration every owned
atom lies within skin/2 of its brick, and a plan sends images within
``w + 1.5 skin`` of a brick, so a plan's peers are the ranks whose bricks lie
within ``w + 2 skin`` of this one (slab metric, periodic images included): a
set both sides compute alike, so send counts go point to point to those peers.
Migration uses the same peers when the rule can vouch for it: an atom that
moved at most ``d`` since the last migration (the global maximum is already
known from the rebuild test) lies within ``skin/2 + d`` of its old brick, so
while that fits in the peers' reach its new owner is a peer. A larger jump (a
restart from other positions, a violent step) takes the general path: one
all-to-all of ``P`` counts, still exact.
A barostat changes the cell with :meth:`ShardedSystem.set_cell`: bricks are
fractional, so they follow the cell, ghost rows are placed with the current
cell, and the rebuild test adds the cell's strain since the last build to the
atoms' displacements (:func:`~halopipe.domain.strain_displacement`).

``ShardedSystem`` implements the :class:`~halopipe.domain.Domain` interface,
so :func:`halopipe.pipeline.evaluate` runs on it unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from ..domain import Domain, DomainConfig, band_index, halo_widths, next_plan_version, skin_margin, strain_displacement
from ..geometry import Geometry, Partition, Placement, choose_grid, images_near_bricks
from ..neighbors import max_displacement
from ..sorting import stable_argsort
from ..system import System
from .comm import Comm
from .fft import PencilMeshTransform, distributed_mesh_transform
from .halo import HaloFold, HaloGather, HaloPlan

__all__ = ["ShardedSystem"]


class ShardedSystem(Domain):
    """The owned part of a system on this rank (see the module docstring)."""

    def __init__(self, comm: Comm, config: DomainConfig, meta: dict) -> None:
        self.comm, self.config = comm, config
        self.cell, self.pbc = meta["cell"], meta["pbc"]
        self.n_total, self.grid = meta["n_total"], meta["grid"]
        self.schema: dict[str, tuple[tuple[int, ...], torch.dtype]] = meta["schema"]
        self.skin = float(config.skin)
        self.plan_version = 0
        self.plan: HaloPlan | None = None
        self.partition: Partition | None = None
        self.rebuilds = 0
        self._ref: torch.Tensor | None = None
        self._ref_cell: torch.Tensor | None = None  # reference positions and cell: those of the last migration
        self._mesh_transforms: dict[tuple, PencilMeshTransform] = {}
        self._peers: list[int] = []
        self._peers_key: tuple | None = None  # (the partition, the reach) that _peers were found for

    # ------------------------------------------------------------- creation
    @classmethod
    def scatter(cls, system: System | None, config: DomainConfig | None = None, src: int = 0) -> ShardedSystem:
        """Distribute ``system`` (held by rank ``src``; ``None`` elsewhere) over all ranks.

        Collective: every rank calls it. Bad input is reported on every rank
        before any data moves.
        """
        config = config or DomainConfig()
        comm = Comm(timeout=config.timeout)
        comm.agree(_scatter_problem(system, config, src, comm))
        meta = None
        if comm.rank == src:
            grid = tuple(config.grid) if config.grid is not None else choose_grid(comm.size, system.cell, system.pbc)
            schema = {k: (tuple(v.shape[1:]), v.dtype) for k, v in system.fields.items()}
            meta = {
                "cell": system.cell.cpu(),
                "pbc": system.pbc.cpu(),
                "n_total": system.n_atoms,
                "grid": grid,
                "schema": schema,
                "dtype": system.dtype,
                "device": str(system.device),
            }
        meta = comm.broadcast_object(meta, src=src)
        device = torch.device(meta["device"]) if comm.rank == src else _local_device(meta["device"])
        meta["cell"], meta["pbc"] = meta["cell"].to(device), meta["pbc"].to(device)
        self = cls(comm, config, meta)
        if comm.rank == src:
            self.positions, self.numbers, self.masses = system.positions, system.numbers, system.masses
            self.ids = torch.arange(system.n_atoms, device=device)
            self.fields = dict(system.fields)
        else:
            dtype = meta["dtype"]
            self.positions = torch.zeros(0, 3, dtype=dtype, device=device)
            self.numbers = torch.zeros(0, dtype=torch.int64, device=device)
            self.masses = torch.zeros(0, dtype=dtype, device=device)
            self.ids = torch.zeros(0, dtype=torch.int64, device=device)
            self.fields = {k: torch.zeros((0,) + shape, dtype=dt, device=device) for k, (shape, dt) in self.schema.items()}
        with comm.guard("scatter"):
            self._repartition(hysteresis=False)
        return self

    # ------------------------------------------------------------ utilities
    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    def gather(self, x: torch.Tensor, root: int | None = None) -> torch.Tensor | None:
        """A per-atom tensor of the owned atoms -> all atoms in the original order.

        On ``root`` only (``None`` elsewhere) when ``root`` is a rank: each rank
        sends its rows and ids there once (trajectories, checkpoints). With
        ``root=None`` on every rank: gathered to rank 0, then broadcast.
        """
        with self.comm.guard("gather"):  # a failure here reaches the peers waiting in the gather
            # ids travel with the rows (float64 holds integers exactly up to 2**53), so root can put rows in order.
            width = math.prod(x.shape[1:])  # explicit: a rank without atoms (or a system of none) has no rows to infer it from
            packed = torch.cat([self.ids[:, None].to(torch.float64), x.detach().reshape(x.shape[0], width).to(torch.float64)], dim=1)
            rows = self.comm.gather_rows(packed, 0 if root is None else root)
            full = None
            if rows is not None:
                full = x.new_empty((self.n_total,) + tuple(x.shape[1:]))
                full.view(self.n_total, width)[rows[:, 0].long()] = rows[:, 1:].to(x.dtype)
            if root is None:
                return self.comm.broadcast(full, (self.n_total,) + tuple(x.shape[1:]), x.dtype, x.device)
            return full

    def to_system(self, root: int | None = None) -> System | None:
        """The whole system, assembled on every rank, or on ``root`` only (``None`` elsewhere)."""
        parts = [self.gather(v, root) for v in (self.positions, self.numbers, self.masses)]
        fields = {k: self.gather(v, root) for k, v in self.fields.items()}
        if parts[0] is None:
            return None
        return System(positions=parts[0], numbers=parts[1], cell=self.cell, pbc=self.pbc, masses=parts[2], fields=fields)

    def global_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.global_sum(x)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.comm.all_reduce(x, op)

    def mesh_transform(self, sizes, decomposition: str = "auto") -> PencilMeshTransform:
        """The FFT of a mesh of ``sizes`` over this system's ranks, in slabs or pencils (cached; see :mod:`.fft`)."""
        key = (tuple(int(n) for n in sizes), decomposition)
        if key not in self._mesh_transforms:
            self._mesh_transforms[key] = distributed_mesh_transform(self.comm, key[0], decomposition)
        return self._mesh_transforms[key]

    def agree(self, problem: str | None) -> None:
        self.comm.agree(problem)

    def guard(self, what: str) -> contextlib.AbstractContextManager:
        return self.comm.guard(what)

    def problem(self, config: DomainConfig) -> str | None:
        problem = config.problem(self.world_size)
        if problem:
            return problem
        if config.grid is not None and tuple(config.grid) != tuple(self.grid):
            grids = f"the pipeline's grid {tuple(config.grid)} differs from the system's grid {tuple(self.grid)}"
            return f"{grids}; scatter with the pipeline's config"
        if float(config.skin) != self.skin:
            return f"the pipeline's skin {config.skin} differs from the system's skin {self.skin}; scatter with the pipeline's config"
        if self.n_owned and not bool(self.positions.sum().isfinite()):  # one pass; a NaN or inf anywhere shows in the sum
            bad = int((~self.positions.isfinite().all(dim=1)).nonzero()[0])
            return f"atom {int(self.ids[bad])} has a non-finite position {self.positions[bad].tolist()}"
        return None

    @property
    def n_exchanged(self) -> int:
        return self.plan.n_ghost

    # ------------------------------------------------------------ the plan
    def set_cell(self, cell: torch.Tensor) -> None:
        """Take a new cell (a barostat's step); positions are the caller's to scale.

        The plan stays valid while the strain since its build, counted as an
        extra displacement by :meth:`prepare`, fits in the skin.
        """
        cell = torch.as_tensor(cell, dtype=self.cell.dtype, device=self.cell.device)
        if cell.shape != (3, 3) or not bool(cell.isfinite().all()) or abs(float(torch.linalg.det(cell.detach().double()))) < 1e-12:
            raise ValueError(f"ShardedSystem.set_cell: expected a finite (3, 3) cell with non-zero volume, got {cell.tolist()}")
        self.cell = cell

    def prepare(self, widths, problem: str | None = None) -> bool:
        """Rebuild plan (with migration) if needed for ``widths`` (one halo width or several); collective.

        Rebuilds when some atom moved, beyond the affine motion a changed cell
        imposes, by more than skin/2 minus the strain's share (see
        :func:`~halopipe.domain.strain_displacement`). ``problem`` is agreed
        (:meth:`agree`) in the same reduction, before any data moves.
        """
        widths = halo_widths(widths)
        stale = self.plan is None or not set(widths) <= set(self.halo_bands)
        bands = halo_widths(self.halo_bands + widths)  # never narrower than planned before
        moved = self._displacement(bands[-1])
        flags = torch.tensor([moved if math.isfinite(moved) else 1e300, float(stale), float(problem is not None)], dtype=torch.float64)
        flags = self.comm.all_reduce(flags, "max")
        self.comm.raise_agreed(problem, bool(flags[2] > 0))
        threshold = 0.5 * self.skin if self.skin > 0 else 0.0
        if flags[1] > 0 or flags[0] > threshold:
            # never narrower than planned before; the global displacement bounds how far any atom can migrate
            self._repartition(hysteresis=True, bands=bands, moved=float(flags[0]))
            return True
        return False

    def _displacement(self, width: float) -> float:
        """Largest non-affine displacement since the last migration plus the strain's equivalent for halo ``width``, Å (inf if unknown)."""
        if self._ref is None or self._ref.shape != self.positions.shape:
            return math.inf
        if torch.equal(self.cell, self._ref_cell):
            return max_displacement(self.positions, self._ref)
        reach = width + skin_margin(self.skin)
        extra, mapping = strain_displacement(self._ref_cell, self.cell, reach)
        return max_displacement(self.positions, self._ref @ mapping.to(self._ref.dtype)) + extra

    def _repartition(self, hysteresis: bool, bands: tuple[float, ...] | None = None, moved: float = math.inf) -> None:
        """Migrate atoms to their bricks' ranks and, given halo widths ``bands`` (:func:`~halopipe.domain.halo_widths`), build the plan.

        ``moved``: the largest displacement of any atom since the last
        migration (all ranks pass the same value).
        """
        old = self.partition
        self.partition = self._build_partition()
        place = self._place()
        if self.world_size == 1 and old is not None:
            # One brick holding every atom (its bounds on an open axis follow them): each atom is in it as wrapped, and
            # nothing migrates. Spares a rebuild the migration's sort (~2 ms at 32k).
            peers = [self.rank]
        else:
            place, peers = self._migrate_to_bricks(old, place, hysteresis, None if bands is None else bands[-1], moved)
        self._ref = self.positions.detach().clone()
        self._ref_cell = self.cell.detach().clone()
        if bands is not None:
            self._build_plan(bands, peers, place)

    def _place(self) -> Placement:
        """The owned rows placed in the partition, as seen from this rank's brick."""
        return self.partition.place(self.partition.geometry.fractional(self.positions), self.rank)

    def _migrate_to_bricks(self, old: Partition | None, place: Placement, hysteresis: bool, width: float | None, moved: float):
        """Send each atom to the rank of its brick, or keep it while within skin/2 of this one (``hysteresis``).

        ``place``: the owned rows' placement before. Returns the owned rows'
        placement after (:meth:`_placement_after`) and the plan's peers.
        """
        new_owner = place.owner
        if hysteresis:
            new_owner = torch.where(place.outside <= 0.5 * self.skin, self.rank, new_owner)
        peers = None
        if width is not None:
            reach = float(width) + skin_margin(self.skin) + 0.5 * self.skin  # ghosts' reach plus an owned atom's hysteresis
            peers = self._peers_within(reach + 1e-6)  # a hair more: faces and excesses round differently
        # An atom was within skin/2 of its old brick at the last migration; the brick's faces moved by at most shift.
        shift = math.inf if old is None else bounds_shift(old, self.partition)
        near = peers is not None and 0.5 * self.skin + moved + shift <= reach
        migrated = self._migrate(new_owner, peers if near else None, copy=old is None)
        return (place if migrated is None else self._placement_after(place, *migrated)), peers

    def _placement_after(self, place: Placement, source: torch.Tensor, arrived: torch.Tensor) -> Placement:
        """The owned rows' placement after a migration: the staying rows keep theirs, the ``arrived`` positions are placed.

        ``source``: where each owned row now comes from, the old owned rows
        then the arrived ones (:meth:`_merge`). Placing goes row by row, so
        this is the placement of all rows afresh, for the few rows that
        arrived (LJ 32k on 2 ranks: ~1.1 ms less a rebuild).
        """
        fresh = self.partition.place(self.partition.geometry.fractional(arrived), self.rank)
        names = [f.name for f in dataclasses.fields(Placement)]
        return Placement(*(torch.cat([getattr(place, name), getattr(fresh, name)]).index_select(0, source) for name in names))

    def _build_partition(self) -> Partition:
        """This rebuild's bricks: the last ones while the cell is periodic and unchanged (their bounds are fixed then)."""
        geo_pbc = self.pbc.cpu()
        lo = hi = None
        if self.partition is not None and bool(geo_pbc.all()) and torch.equal(self.cell, self._ref_cell):
            return self.partition
        if not bool(geo_pbc.all()):
            frac = Geometry(self.cell, self.pbc).fractional(self.positions)
            big = torch.full((3,), math.inf, dtype=torch.float64, device=frac.device)
            lo = -self.comm.all_reduce(-(frac.min(dim=0).values if frac.shape[0] else big), "max")
            hi = self.comm.all_reduce(frac.max(dim=0).values if frac.shape[0] else -big, "max")
        return Partition.build(self.grid, self.cell, self.pbc, lo, hi)

    def _peers_within(self, reach: float) -> list[int]:
        """:func:`bricks_within` this rank's brick, remembered for the partition and reach it was found for."""
        if self._peers_key is None or self._peers_key[0] is not self.partition or self._peers_key[1] != reach:
            self._peers, self._peers_key = bricks_within(self.partition, self.rank, reach), (self.partition, reach)
        return self._peers

    def _build_plan(self, bands: tuple[float, ...], peers: list[int], place: Placement) -> None:
        """The halo plan for the halo widths ``bands``; ``place``: the owned rows' placement."""
        part = self.partition
        ranks = torch.full((self.n_owned,), self.rank, dtype=torch.int32, device=self.positions.device)
        self.owned_shift = place.home - place.image
        width = bands[-1] + skin_margin(self.skin)
        images = images_near_bricks(part, place.wrapped, place.image, width, own_rank=ranks, own_image=place.home)
        self.plan = HaloPlan(self.comm, images, self.numbers, self.ids, peers, self.band_limits(bands))
        self.ghost_numbers, self.ghost_ids = self.plan.ghost_numbers, self.plan.ghost_ids
        self.ghost_shift, self.ghost_band = self.plan.ghost_shift, self.plan.ghost_band
        self.halo_bands = bands
        self.band_ends = tuple(self.plan.counts(b)[2] for b in range(len(bands)))
        self.plan_version = next_plan_version()
        self.rebuilds += 1

    def ghost_rows(self, x: torch.Tensor, width: float, known: torch.Tensor | None = None) -> torch.Tensor:
        band = band_index(self.halo_bands, width)
        if not _differentiated(x):  # the plain exchange: an autograd Function costs ~10 µs a call more
            return known if known is not None else self.plan.forward_rows(x, band)
        return HaloGather.apply(x, self.plan, band, known)

    def fold_ghosts(self, x_ghost: torch.Tensor, width: float) -> torch.Tensor:
        band = band_index(self.halo_bands, width)
        if not _differentiated(x_ghost):
            return self.plan.backward_rows(x_ghost, self.n_owned, band)
        return HaloFold.apply(x_ghost, self.plan, self.n_owned, band)

    def own_images(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The rows this rank sends itself: its own atoms' images, in the order they arrive.
        empty = torch.zeros(0, dtype=torch.int64, device=self.positions.device)
        return self.plan.recv_slot.get(self.rank, empty), self.plan.send_index.get(self.rank, empty)

    def foreign_ghosts(self) -> tuple[torch.Tensor, torch.Tensor]:
        sources = [s for s in sorted(self.plan.recv_slot) if s != self.rank]
        if not sources:
            return super().foreign_ghosts()
        ghost = torch.cat([self.plan.recv_slot[s] for s in sources])
        below = torch.cat([torch.full((self.plan.recv_slot[s].numel(),), self.rank < s, device=ghost.device) for s in sources])
        return ghost, below

    # ------------------------------------------------------------ migration
    def _migrate(self, dest: torch.Tensor, peers: list[int] | None, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Send each owned atom to rank ``dest``; keep atoms sorted by global id.

        Returns None where the arrays stayed as they were; else where each
        owned row now comes from (:meth:`_merge`) and the arrived positions.

        ``peers``: the ranks that may send or receive atoms (all ranks when
        ``None``). Only the atoms that leave are packed and sent; the ones
        that stay are gathered with the arrivals into id order, one pass per
        array. Where nobody leaves or arrives (always so on one rank) the
        arrays stay as they are, unless ``copy`` (the scatter's first
        migration, which copies the input into sorted arrays of its own).
        """
        stays = dest == self.rank
        leaving = torch.nonzero(~stays)[:, 0]
        leaving = leaving.index_select(0, stable_argsort(dest.index_select(0, leaving)))  # grouped by destination
        ranks, counts = torch.unique_consecutive(dest.index_select(0, leaving), return_counts=True)
        send_counts = dict(zip(ranks.tolist(), counts.tolist()))
        recv_counts = self.comm.exchange_counts(send_counts, peers)
        if not copy and not send_counts and not recv_counts:
            return None
        received = []
        for data, dtype in zip(self._pack(leaving), (self.positions.dtype, torch.int64)):
            sends = dict(zip(send_counts, torch.split(data, list(send_counts.values())))) if send_counts else {}
            shapes = {s: (c, data.shape[1]) for s, c in recv_counts.items()}
            got = self.comm.exchange(sends, shapes, dtype, data.device)
            received.append(torch.cat([got[s] for s in sorted(got)]) if got else data[:0])
        return self._merge(torch.nonzero(stays)[:, 0], *received), received[0][:, :3]

    def _pack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The given owned rows as one float block (positions, masses, float fields) and one int64 block (numbers, ids, the rest)."""
        n, dtype = rows.numel(), self.positions.dtype
        pick = lambda x: x.detach().index_select(0, rows)  # noqa: E731
        floats = [pick(self.positions), pick(self.masses)[:, None]]
        ints = [pick(self.numbers)[:, None], pick(self.ids)[:, None]]
        for name, (shape, dt) in self.schema.items():
            value = pick(self.fields[name]).reshape(n, math.prod(shape))
            (floats if dt.is_floating_point else ints).append(value.to(dtype if dt.is_floating_point else torch.int64))
        return torch.cat(floats, dim=1), torch.cat(ints, dim=1)

    def _merge(self, staying: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
        """The ``staying`` owned rows and the arrived ones (blocks as :meth:`_pack` makes them) as the owned rows, in id order.

        Returns where each new row comes from: an index into the old owned rows followed by the arrived ones.
        """
        n, k = self.n_owned, floats.shape[0]
        # where each new row comes from in (the owned rows, then the arrived ones): one gather per array
        source = _id_order_source(staying, self.ids.index_select(0, staying), ints[:, 1], n)

        def merged(mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
            return torch.cat([mine.detach(), theirs.reshape((k,) + mine.shape[1:]).to(mine.dtype)]).index_select(0, source)

        self.positions, self.masses = merged(self.positions, floats[:, :3]), merged(self.masses, floats[:, 3])
        self.numbers, self.ids = merged(self.numbers, ints[:, 0]), merged(self.ids, ints[:, 1])
        fields, fcol, icol = {}, 4, 2
        for name, (shape, dt) in self.schema.items():
            width = math.prod(shape)
            if dt.is_floating_point:
                fields[name] = merged(self.fields[name], floats[:, fcol : fcol + width])
                fcol += width
            else:
                fields[name] = merged(self.fields[name], ints[:, icol : icol + width])
                icol += width
        self.fields = fields
        return source


def _id_order_source(staying: torch.Tensor, staying_ids: torch.Tensor, arrived_ids: torch.Tensor, n_owned: int) -> torch.Tensor:
    """Where each merged owned row, in id order, comes from: a ``staying`` old owned row, or ``n_owned + j`` for arrival ``j``.

    The staying rows' ids (``staying_ids``) ascend already, the owned rows
    being in id order, so only the few arrivals are sorted, then slotted in
    by a binary search: the same order as a stable sort of all the ids (ids
    are distinct), without sorting the rows that stay (LJ 32k on 2 ranks,
    16,000 rows: the radix sort took ~0.4 ms a migration).
    """
    device, k = staying.device, arrived_ids.numel()
    by_id = stable_argsort(arrived_ids)
    # arrival j (by id) lands after the staying rows of lower id and the j arrivals before it
    slot = torch.searchsorted(staying_ids, arrived_ids.index_select(0, by_id)) + torch.arange(k, device=device)
    source = torch.empty(staying.numel() + k, dtype=torch.int64, device=device)
    source.index_copy_(0, slot, by_id + n_owned)
    stays = torch.ones(source.numel(), dtype=torch.bool, device=device).index_fill_(0, slot, False)
    return source.masked_scatter_(stays, staying)


def _differentiated(x: torch.Tensor) -> bool:
    """Whether an operation on ``x`` is recorded for autograd here (grad mode on and ``x`` requiring grad)."""
    return torch.is_grad_enabled() and x.requires_grad


def bricks_within(partition: Partition, rank: int, reach: float) -> list[int]:
    """Ranks whose bricks lie within ``reach`` Å of ``rank``'s brick (slab metric, any periodic image; itself included).

    Symmetric: rank ``a`` lists ``b`` exactly when ``b`` lists ``a``. Costs
    ``O(p)`` per axis plus the size of the answer, never ``O(P)``.
    """
    mine = partition.brick_index_of_rank(torch.tensor([rank]))[0].tolist()
    per_axis = []
    for a in range(3):
        bounds = partition.bounds[a].cpu()
        lo, hi = bounds[:-1], bounds[1:]
        shifts = torch.tensor([-1.0, 0.0, 1.0] if partition.geometry.pbc[a] else [0.0], dtype=torch.float64)
        i = mine[a]
        # Gap between brick i and each brick's images, per image; inside or touching is 0.
        gap = torch.maximum(lo[:, None] + shifts - hi[i], lo[i] - hi[:, None] - shifts).clamp(min=0.0)
        gap = torch.nan_to_num(gap, nan=0.0).min(dim=1).values * float(partition.geometry.heights[a])
        per_axis.append((gap <= reach).nonzero()[:, 0])
    index = torch.cartesian_prod(*per_axis).reshape(-1, 3)
    return sorted(partition.rank_of(index).tolist())


def bounds_shift(old: Partition, new: Partition) -> float:
    """The largest distance (Å) any inner brick face moved between two partitions (non-periodic axes follow the atoms)."""
    shift = 0.0
    for a in range(3):
        inner_old, inner_new = old.bounds[a][1:-1].cpu(), new.bounds[a][1:-1].cpu()
        if inner_new.numel():
            shift = max(shift, float((inner_new - inner_old).abs().max()) * float(new.geometry.heights[a]))
    return shift


def _local_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _scatter_problem(system, config: DomainConfig, src: int, comm: Comm) -> str | None:
    """Everything wrong with the scatter's input on this rank, checked before any data moves."""
    if not 0 <= src < comm.size:
        return f"ShardedSystem.scatter: src={src} is not a rank (world size {comm.size})"
    problem = config.problem(comm.size)
    if problem:
        return problem
    if comm.rank == src and system is None:
        return f"ShardedSystem.scatter: the source rank {src} must pass the System (got None)"
    if comm.rank != src and system is not None:
        return (
            f"ShardedSystem.scatter: a System was passed on rank {comm.rank}, but only the source rank {src} may hold it; "
            "pass None on the other ranks"
        )
    if comm.rank == src:
        if not isinstance(system, System):
            return f"ShardedSystem.scatter: expected a halopipe.System, got {type(system).__name__}"
        try:
            system.validate()
            system.check_close_contacts()
        except ValueError as exc:
            return str(exc)
    return None
