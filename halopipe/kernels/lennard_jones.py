"""Lennard-Jones on a half list: each unordered pair once, Newton's third law.

A view's half candidate list (built at ``cutoff + skin``, unchanged until the
next rebuild; see :func:`halopipe.neighbors.owned_half_pairs`) holds each
owned-owned and each owned-ghost pair once. :class:`HalfList` adds, per pair,
the index of its species pair in small parameter tables; it is built once per
rebuild. Every step then reads the candidates once: pairs beyond the cutoff
are skipped inside the kernel (no compaction), with ``r^2`` only (no square
root).

Energy: each pair gives half its energy to each end; a ghost end's half
belongs to the ghost's owner, who sees the same pair from its side, so only
owned rows' energies are kept. Forces are ``-dE/d(rows)`` of
``E = sum_owned g_i e_i`` for per-row weights ``g`` (1 on owned rows and 0 on
ghosts for direct forces; the incoming gradient in autograd's backward): the
pair force carries ``(g_i + g_j) / 2``.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from .backend import warp_module

__all__ = ["HalfList", "LJTables", "lj_energy_forces", "lj_energies_autograd"]


@dataclass(frozen=True)
class LJTables:
    """Per species pair: ``a12 = 4 eps sigma^12``, ``b6 = 4 eps sigma^6``, ``shift = u_LJ(r_c)`` (0 if unshifted)."""

    a12: torch.Tensor
    b6: torch.Tensor
    shift: torch.Tensor
    cutoff: float


@dataclass(frozen=True)
class HalfList:
    """Each unordered pair of a candidate list once, with its species-pair index (int32)."""

    first: torch.Tensor
    second: torch.Tensor
    ptype: torch.Tensor

    @staticmethod
    def from_pairs(pairs: torch.Tensor, species_index: torch.Tensor, n_species: int) -> HalfList:
        """From a half list (2, P); ``species_index`` maps each row to 0..n_species-1."""
        first, second = pairs[0], pairs[1]
        ptype = species_index[first] * n_species + species_index[second]
        as32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731 - Warp kernels index with int32
        return HalfList(as32(first), as32(second), as32(ptype))

    @property
    def n_pairs(self) -> int:
        return int(self.first.numel())


@functools.cache
def _warp_kernel():
    """The compiled Warp kernel, or None (with a warning) when it cannot be built."""
    wp = warp_module()
    if wp is None:
        return None
    try:
        from . import _warp_lj

        wp.load_module(_warp_lj, device="cpu")
        return _warp_lj.lj_half_list
    except Exception as exc:  # no compiler, unsupported platform: fall back, never crash
        warnings.warn(f"halopipe: Warp kernel build failed ({exc}); Lennard-Jones runs in eager torch", stacklevel=2)
        return None


def _torch_kernel(rows, half: HalfList, tables: LJTables, weight, energies, forces) -> None:
    """Eager twin of the Warp kernel: the same arithmetic with a mask instead of an early return."""
    first, second = half.first.long(), half.second.long()
    d = rows[second] - rows[first]
    r2 = (d * d).sum(dim=1)
    inside = r2 <= tables.cutoff**2
    inv2 = torch.where(inside, 1.0 / r2, torch.zeros_like(r2))
    inv6 = inv2 * inv2 * inv2
    t = half.ptype.long()
    a12, b6 = tables.a12[t], tables.b6[t]
    half_u = torch.where(inside, 0.5 * ((a12 * inv6 - b6) * inv6 - tables.shift[t]), torch.zeros_like(r2))
    energies.index_add_(0, first, half_u).index_add_(0, second, half_u)
    c = 0.5 * (weight[first] + weight[second])
    f = (c * (12.0 * a12 * inv6 - 6.0 * b6) * inv6 * inv2)[:, None] * d
    forces.index_add_(0, second, f).index_add_(0, first, -f)


def lj_energy_forces(rows: torch.Tensor, half: HalfList, tables: LJTables, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row energies (R,) and forces (R, 3) = ``-d(sum_i weight_i e_i)/d(rows)``; see the module docstring."""
    rows = rows.detach().contiguous()
    energies = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    forces = torch.zeros_like(rows)
    if half.n_pairs == 0:
        return energies, forces
    kernel = _warp_kernel() if rows.dtype == torch.float64 else None
    if kernel is None:
        _torch_kernel(rows, half, tables, weight, energies, forces)
        return energies, forces
    wp = warp_module()
    device = wp.device_from_torch(rows.device)
    stream = wp.stream_from_torch(rows.device) if device.is_cuda else None
    vec = lambda x: wp.from_torch(x, dtype=wp.vec3d)  # noqa: E731
    inputs = [vec(rows), wp.from_torch(half.first), wp.from_torch(half.second), wp.from_torch(half.ptype)]
    inputs += [wp.from_torch(tables.a12), wp.from_torch(tables.b6), wp.from_torch(tables.shift), wp.from_torch(weight.contiguous())]
    inputs += [tables.cutoff**2]
    wp.launch(kernel, dim=half.n_pairs, inputs=inputs, outputs=[wp.from_torch(energies), vec(forces)], device=device, stream=stream)
    return energies, forces


class _LJEnergies(torch.autograd.Function):
    """Owned energies with an analytic backward (the kernel's forces)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, half: HalfList, tables: LJTables, n_owned: int) -> torch.Tensor:
        weight = _owned_weight(rows, n_owned)
        energies, forces = lj_energy_forces(rows, half, tables, weight)
        ctx.save_for_backward(rows, forces)
        ctx.half, ctx.tables, ctx.n_owned = half, tables, n_owned
        return energies[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, forces = ctx.saved_tensors
        if grad.numel() == 0 or bool((grad == grad[0]).all()):
            # The usual case (a sum of energies): forces already carry weight 1 on owned rows.
            scale = grad[0] if grad.numel() else 0.0
            return -scale * forces, None, None, None
        weight = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)])
        _, weighted = lj_energy_forces(rows, ctx.half, ctx.tables, weight)
        return -weighted, None, None, None


def _owned_weight(rows: torch.Tensor, n_owned: int) -> torch.Tensor:
    weight = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    weight[:n_owned] = 1.0
    return weight


def lj_energies_autograd(rows: torch.Tensor, half: HalfList, tables: LJTables, n_owned: int) -> torch.Tensor:
    """Owned energies (n_owned,), differentiable with respect to ``rows``."""
    return _LJEnergies.apply(rows, half, tables, n_owned)
