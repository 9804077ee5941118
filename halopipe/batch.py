"""Batches: many independent systems evaluated in one call.

A :class:`Batch` is a list of :class:`~halopipe.System` s that may differ in
everything (atom count, species, cell, periodicity): a molecule next to a
crystal next to a slab. ``pipeline([s1, s2, ...])`` (or ``pipeline(batch)``)
returns per-system energies and stress, shape ``(B,)`` and ``(B, 3, 3)``, and
per-atom results in the concatenated atom order; :meth:`Batch.split` turns
such a result back into one dict per system.

On one process a batch is a :class:`BatchDomain`: the systems' own
:class:`~halopipe.domain.LocalDomain` s (each with its cell, images and ghost
plan) side by side. Their owned rows are concatenated, and their ghost rows
merged in band order, so a halo width is still a prefix of the rows
and the batch is one :class:`~halopipe.domain.Domain` to the pipeline. Pair
lists are searched per system and concatenated with their indices shifted,
so no pair crosses two systems. A model that sets ``batchable = True`` (its
energy is a sum of pair and per-atom terms over the rows it is given, and any
sum over atoms goes through :meth:`~halopipe.models.LocalView.system_sum`)
sees the whole batch in one view, whose ``system`` says which system each row
belongs to; any other model (Ewald, PME, D3's lattice sums) sees one view per
system, the very views it would see alone. The strain of the stress is one
per system, so the virial is ``(B, 3, 3)``.

Under a process group of several ranks, ``halopipe.distributed`` places each
system (:class:`BatchPlacement`): large systems are split in space over all
ranks one after the other, small ones go whole to one rank each, balanced by
atom count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .domain import DEFAULT_SKIN, Domain, LocalDomain, band_ends, next_plan_version
from .neighbors import GroupedPairs
from .sorting import stable_argsort
from .system import System

__all__ = ["Batch", "BatchDomain", "BatchPlacement", "PER_SYSTEM_KEYS"]

PER_SYSTEM_KEYS = frozenset({"energy", "stress", "virial"})
"""Result keys with one entry per system in a batch (``model_energies`` holds such entries too)."""


class Batch:
    """Several independent systems for one pipeline call.

    Parameters
    ----------
    systems : the :class:`~halopipe.System` s, in order. They must share one
        dtype and device and carry the same per-atom fields (names, trailing
        shapes and dtypes): per-atom results are concatenated.
    labels : each system's index in messages (default ``0, 1, ...``; a rank's
        share of a larger batch keeps the indices of the whole batch).
    """

    def __init__(self, systems: Sequence[System], labels: Sequence[int] | None = None) -> None:
        systems = list(systems.systems if isinstance(systems, Batch) else systems)
        problem = batch_problem(systems)
        if problem:
            raise ValueError(f"Batch: {problem}")
        self.systems = systems
        self.labels = list(range(len(systems))) if labels is None else list(labels)
        self.sizes = [s.n_atoms for s in systems]
        self.starts = [sum(self.sizes[:b]) for b in range(len(systems) + 1)]

    def __len__(self) -> int:
        return len(self.systems)

    @property
    def n_atoms(self) -> int:
        """Atoms in all systems together."""
        return self.starts[-1]

    def atoms_of(self, b: int) -> slice:
        """Rows of system ``b`` in the concatenated atom order."""
        return slice(self.starts[b], self.starts[b + 1])

    def split(self, result: dict) -> list[dict]:
        """One result dict per system, shaped as a single-system call returns it.

        Per-system entries (``energy``, ``stress``, ``virial``, each of
        ``model_energies``) are indexed, per-atom ones (``forces``,
        ``energies``, ``fields``, ``d_energy_d_*``) sliced; ``halo`` is left out.
        """
        return [self._one(result, b) for b in range(len(self))]

    def _one(self, result: dict, b: int) -> dict:
        rows = self.atoms_of(b)
        out = {}
        for key, value in result.items():
            if key in PER_SYSTEM_KEYS:
                out[key] = value[b]
            elif key == "model_energies":
                out[key] = {name: e[b] for name, e in value.items()}
            elif key == "fields":
                out[key] = {name: v[rows] for name, v in value.items()}
            elif key != "halo":
                out[key] = value[rows]
        return out


def batch_problem(systems: list) -> str | None:
    """What keeps ``systems`` from forming one batch, if anything."""
    if not systems:
        return "a batch needs at least one system"
    for b, s in enumerate(systems):
        if not isinstance(s, System):
            return f"item {b} is a {type(s).__name__}, not a halopipe.System; convert ASE Atoms with System.from_ase"
    first = systems[0]
    schema = _field_schema(first)
    for b, s in enumerate(systems[1:], start=1):
        if s.dtype != first.dtype or s.device != first.device:
            return (
                f"system {b} is {s.dtype} on {s.device} but system 0 is {first.dtype} on {first.device}; "
                f"one batch holds one dtype and device: convert with system.to(dtype=..., device=...)"
            )
        if _field_schema(s) != schema:
            return (
                f"system {b} carries fields {_field_schema(s)} but system 0 carries {schema}; "
                "every system of a batch needs the same per-atom fields (names, trailing shapes, dtypes)"
            )
    return None


def _field_schema(system: System) -> dict:
    return {k: (tuple(v.shape[1:]), str(v.dtype).replace("torch.", "")) for k, v in sorted(system.fields.items())}


class BatchDomain(LocalDomain):
    """A batch on one process: the systems' local domains side by side, seen as one domain.

    Owned rows are the systems' atoms concatenated (``system`` gives each
    row's system); ghost rows are the systems' periodic images, merged in
    band order so that a halo width is a prefix; ``cell`` is
    ``(B, 3, 3)`` and ``pbc`` ``(B, 3)``. ``parts`` are the systems' own
    :class:`~halopipe.domain.LocalDomain` s: models that cannot take a whole
    batch see one of them at a time.

    Parameters
    ----------
    batch : the :class:`Batch`.
    skin : neighbour-list skin, Å.
    """

    def __init__(self, batch: Batch, skin: float = DEFAULT_SKIN) -> None:
        self.batch = batch
        self.parts = [LocalDomain(s, skin=skin) for s in batch.systems]
        self.skin = float(skin)
        self.n_systems = len(batch)
        self.n_total = batch.n_atoms
        device = batch.systems[0].device
        self.ids = torch.arange(self.n_total, device=device)
        sizes = torch.tensor(batch.sizes, device=device)
        self.system = torch.repeat_interleave(torch.arange(self.n_systems, device=device), sizes)
        self.system_sizes = sizes
        self.numbers = torch.cat([s.numbers for s in batch.systems])
        self.pbc = torch.stack([s.pbc for s in batch.systems])
        self.plan_version = 0
        self._take(batch.systems)

    def _take(self, systems: list[System]) -> None:
        self.positions = torch.cat([s.positions for s in systems])
        self.masses = torch.cat([s.masses for s in systems])
        self.cell = torch.stack([s.cell for s in systems])
        self.fields = {k: torch.cat([s.fields[k] for s in systems]) for k in systems[0].fields}

    def update(self, batch: Batch) -> None:
        """Take new positions, cells and fields of the same atoms (plans kept where still valid)."""
        for part, system in zip(self.parts, batch.systems):
            part.update(system)
        self.batch = batch
        self._take(batch.systems)

    def compatible(self, batch: Batch) -> bool:
        return len(batch) == len(self.parts) and all(p.compatible(s) for p, s in zip(self.parts, batch.systems))

    def label(self, b: int) -> str:
        """How messages name system ``b``: ``"system 3 of the batch"`` (its index in the whole batch)."""
        return f"system {self.batch.labels[b]} of the batch"

    def part_rows(self, b: int) -> slice:
        """Owned rows of system ``b``."""
        return self.batch.atoms_of(b)

    def prepare(self, widths, problem: str | None = None) -> bool:
        self.agree(problem)
        rebuilt = [part.prepare(widths) for part in self.parts]
        if any(rebuilt) or self.plan_version == 0:
            self._merge()
            return True
        return False

    def _merge(self) -> None:
        """The systems' ghost rows as one list in band order, and where each system's ghosts landed in it.

        The parts are prepared alike, so they share their bands.
        """
        starts = self.batch.starts
        atom = torch.cat([p.ghost_atom + starts[b] for b, p in enumerate(self.parts)])
        band = torch.cat([p.ghost_band for p in self.parts])
        counts = torch.tensor([p.ghost_atom.numel() for p in self.parts], device=self.ids.device)
        order = stable_argsort(band)
        self.halo_bands = self.parts[0].halo_bands
        self.band_ends = band_ends(band, len(self.halo_bands))
        self.ghost_atom = atom[order]
        self.ghost_band = band[order]
        self.ghost_shift = torch.cat([p.ghost_shift for p in self.parts])[order]
        self.ghost_system = torch.repeat_interleave(torch.arange(self.n_systems, device=counts.device), counts)[order]
        self.ghost_numbers = self.numbers[self.ghost_atom]
        self.ghost_ids = self.ghost_atom
        self.owned_shift = torch.cat([p.owned_shift for p in self.parts])
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)
        edges = [0] + torch.cumsum(counts, 0).tolist()
        self._slots = [slot[edges[b] : edges[b + 1]] for b in range(self.n_systems)]
        self._pair_lists_of_plan: dict = {}
        self.plan_version = next_plan_version()

    def row_offsets(self, cell: torch.Tensor, n_ghost: int) -> torch.Tensor:
        """``shift @ cell`` of the owned rows, then of the first ``n_ghost`` ghost rows, each by its system's cell ``(B, 3, 3)``."""
        shifts = torch.cat([self.owned_shift, self.ghost_shift[:n_ghost]]).to(cell.dtype)
        return torch.einsum("ni,nij->nj", shifts, cell[self.row_systems(n_ghost)])

    def row_systems(self, n_ghost: int) -> torch.Tensor:
        """System index of the owned rows and the first ``n_ghost`` ghost rows."""
        return torch.cat([self.system, self.ghost_system[:n_ghost]])

    def strained(self, positions: torch.Tensor, strain: torch.Tensor) -> torch.Tensor:
        """Owned ``positions`` under a per-system ``strain`` (B, 3, 3): ``r @ strain[system of r]``."""
        return torch.einsum("ni,nij->nj", positions, strain[self.system])

    def candidate_pairs(self, rows: torch.Tensor, n_ghost: int, cutoff: float, kind: str) -> GroupedPairs | torch.Tensor:
        """Each system's own candidate pairs (searched and kept by its part), renumbered into the batch's rows.

        No pair crosses systems; half and one-holder lists stay grouped by
        owned row (owned rows are in system order), so their offsets
        concatenate. A one-holder list's holders are decided by each system's
        own ids.
        """
        key = (n_ghost, float(cutoff), kind)
        if key in self._pair_lists_of_plan:
            return self._pair_lists_of_plan[key]
        n = self.n_owned
        per_system = torch.bincount(self.ghost_system[:n_ghost], minlength=self.n_systems).tolist()
        found = []
        for b, (part, n_ghost_b) in enumerate(zip(self.parts, per_system)):
            owned, slots = self.part_rows(b), self._slots[b][:n_ghost_b]
            index = torch.cat([torch.arange(owned.start, owned.stop, device=rows.device), n + slots])
            found.append((index, part.candidate_pairs(torch.cat([rows[owned], rows[n + slots]]), n_ghost_b, cutoff, kind)))
        if kind == "directed":
            merged = torch.cat([index[pairs] for index, pairs in found], dim=1)
        else:
            merged = _merged_half_lists(found, rows.device)
        self._pair_lists_of_plan[key] = merged
        return merged


def _merged_half_lists(found: list[tuple[torch.Tensor, GroupedPairs]], device: torch.device) -> GroupedPairs:
    """One grouped list of the systems' grouped lists: partners renumbered by ``index``, offsets shifted by the pairs before."""
    partners, offsets, total = [], [torch.zeros(1, dtype=torch.int32, device=device)], 0
    for index, grouped in found:
        partners.append(index[grouped.partners.long()].to(torch.int32))
        offsets.append(grouped.start[1:] + total)
        total += grouped.n_pairs
    return GroupedPairs(torch.cat(partners), torch.cat(offsets))


@dataclass
class BatchPlacement:
    """Where each system of a batch is evaluated under a process group (made by ``halopipe.distributed``).

    Attributes
    ----------
    sizes : atoms of every system of the batch, in order (known on every rank).
    dtype : the batch's dtype; ``device``: this rank's device.
    whole : indices of the systems this rank evaluates whole, on its own.
    whole_systems : those systems.
    split : ``(index, domain)`` of the systems split in space over all ranks,
        in the same order on every rank (each a decomposed
        :class:`~halopipe.domain.Domain`).
    fields : the batch's per-atom fields, one empty row each (names, shapes, dtypes).
    all_reduce : sum over ranks (non-differentiable).
    guard : context in which an exception on one rank becomes an error on all.
    agree : raise a problem that any rank has on every rank.
    share : every rank's picklable object, by rank.
    is_root : whether this is rank 0.
    """

    sizes: list[int]
    dtype: torch.dtype
    device: torch.device
    whole: list[int]
    whole_systems: list[System]
    split: list[tuple[int, Domain]]
    fields: dict[str, torch.Tensor]
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    guard: Callable[[str], contextlib.AbstractContextManager]
    agree: Callable[[str | None], None]
    share: Callable[[object], list]
    is_root: bool
