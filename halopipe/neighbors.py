"""Neighbour lists on top of vesin.

Two searches are offered. :func:`neighbor_list` is the classic periodic list
(pairs ``i, j`` and integer cell shifts ``S`` with ``r_ij = r_j + S @ cell - r_i``).
:func:`owned_pairs` works on a local view, where periodic images are already
explicit ghost rows: it returns every pair within the cutoff whose centre is an
owned row. Only indices come from vesin; vectors and distances are recomputed
in torch (:func:`pair_vectors`) so autograd flows through them.

A :class:`VerletList` keeps a list built at ``cutoff + skin`` and reuses it
while no atom has moved more than ``skin / 2``.
"""

from __future__ import annotations

import numpy as np
import torch
from vesin import NeighborList as _VesinNeighborList

__all__ = ["neighbor_list", "owned_pairs", "pair_vectors", "VerletList", "max_displacement"]


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def neighbor_list(
    positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, cutoff: float, full: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs within ``cutoff`` of a periodic (or partly periodic) system.

    Returns ``i``, ``j`` (int64) and integer ``shifts`` (P, 3) such that the
    pair vector is ``positions[j] + shifts @ cell - positions[i]``. Cutoffs
    larger than the cell are supported (several images of one atom).
    """
    if cutoff <= 0:
        raise ValueError(f"neighbor_list: cutoff must be positive, got {cutoff}")
    pbc_list = [bool(p) for p in pbc.tolist()]
    box = _np(cell) if any(pbc_list) else np.zeros((3, 3))
    nl = _VesinNeighborList(cutoff=float(cutoff), full_list=full)
    i, j, s = nl.compute(points=_np(positions), box=box, periodic=pbc_list, quantities="ijS", copy=True)
    dev = positions.device
    return (
        torch.as_tensor(i.astype(np.int64), device=dev),
        torch.as_tensor(j.astype(np.int64), device=dev),
        torch.as_tensor(s.astype(np.int64), device=dev).reshape(-1, 3),
    )


def owned_pairs(rows: torch.Tensor, n_owned: int, cutoff: float) -> torch.Tensor:
    """Directed pairs ``(i, j)`` within ``cutoff`` of rows, with ``i < n_owned``.

    ``rows`` are explicit coordinates (owned rows first, then ghost images), so
    the search is non-periodic. A half list is searched once; each unordered
    pair yields a directed pair for every owned end.
    """
    if rows.shape[0] < 2:
        return torch.zeros(2, 0, dtype=torch.int64, device=rows.device)
    nl = _VesinNeighborList(cutoff=float(cutoff), full_list=False)
    a, b = nl.compute(points=_np(rows), box=np.zeros((3, 3)), periodic=False, quantities="ij", copy=True)
    a = torch.as_tensor(a.astype(np.int64), device=rows.device)
    b = torch.as_tensor(b.astype(np.int64), device=rows.device)
    fwd = a < n_owned
    bwd = b < n_owned
    i = torch.cat([a[fwd], b[bwd]])
    j = torch.cat([b[fwd], a[bwd]])
    order = torch.argsort(i * rows.shape[0] + j)  # deterministic order, grouped by centre
    return torch.stack([i[order], j[order]])


def pair_vectors(positions: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable pair vectors ``r_j - r_i`` and their lengths."""
    vec = positions[pairs[1]] - positions[pairs[0]]
    return vec, vec.norm(dim=1)


def max_displacement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest distance any atom moved between two position arrays."""
    if a.shape != b.shape or a.numel() == 0:
        return float("inf") if a.shape != b.shape else 0.0
    return float((a.detach() - b.detach()).norm(dim=1).max())


class VerletList:
    """A periodic neighbour list with a skin, rebuilt only when needed.

    Parameters
    ----------
    cutoff : interaction cutoff, Å.
    skin : extra search radius, Å. The list built at ``cutoff + skin`` stays
        valid while no atom moves more than ``skin / 2`` and the cell and
        species are unchanged.
    """

    def __init__(self, cutoff: float, skin: float = 0.0) -> None:
        if skin < 0:
            raise ValueError(f"VerletList: skin must be >= 0, got {skin}")
        self.cutoff, self.skin = float(cutoff), float(skin)
        self._ref: torch.Tensor | None = None
        self._cell: torch.Tensor | None = None
        self._candidates = None
        self.builds = 0

    def needs_rebuild(self, positions: torch.Tensor, cell: torch.Tensor) -> bool:
        if self._ref is None or self._ref.shape != positions.shape or not torch.equal(self._cell, cell.detach()):
            return True
        moved = max_displacement(positions, self._ref)
        return moved > 0.5 * self.skin if self.skin > 0 else moved > 0.0

    def __call__(self, positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor):
        """Pairs ``i, j, shifts`` within ``cutoff`` for the current positions."""
        if self.needs_rebuild(positions, cell):
            self._candidates = neighbor_list(positions, cell, pbc, self.cutoff + self.skin)
            self._ref, self._cell = positions.detach().clone(), cell.detach().clone()
            self.builds += 1
        i, j, s = self._candidates
        vec = positions[j] + s.to(positions.dtype) @ cell - positions[i]
        keep = vec.norm(dim=1) <= self.cutoff
        return i[keep], j[keep], s[keep]
