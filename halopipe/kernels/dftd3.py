"""DFT-D3 two-body term with Becke-Johnson damping on a half list (see :mod:`.pairs`).

``u = -(s6 C6 / (r^6 + R0^6) + s8 C8 / (r^8 + R0^8))`` with ``C8 = qq C6`` and
``C6 = w_a^T C6ref(Z_a, Z_b) w_b``, where ``w`` are each row's normalised
Gaussian reference weights (functions of its coordination number). The kernel
returns energies, forces at fixed weights and ``dE/dw`` per row; the weights'
dependence on the coordination numbers (and theirs on positions, ghosts
refreshed from owners) stays in torch autograd, so the chain is exact.
Only the Warp kernel exists; without it the model keeps its torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import warp_module
from .pairs import HalfList, launch, owned_weight, uniform_scale, warp_kernel

__all__ = ["D3Tables", "d3_kernel_available", "d3_two_body_autograd", "d3_coordination_numbers", "ghost_pairs_once"]


@dataclass(frozen=True)
class D3Tables:
    """Per species pair (flattened ``s_a * S + s_b``): C6 references (S*S*n*n), ``C8/C6``, ``R0^6``, ``R0^8``; and scalars."""

    c6ref: torch.Tensor
    c8_over_c6: torch.Tensor
    r0_6: torch.Tensor
    r0_8: torch.Tensor
    n_species: int
    n_ref: int
    s6: float
    s8: float
    cutoff: float


def d3_kernel_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float64 and warp_kernel("d3_bj_half_list") is not None  # CN kernels share the module


def ghost_pairs_once(half: HalfList, ids: torch.Tensor, rows: torch.Tensor, n_owned: int) -> HalfList:
    """The pairs of ``half`` that this rank keeps when each pair with a ghost is evaluated on one side only.

    An owned-centred half list holds a pair of an owned row and a ghost on
    both ranks that see it (on one rank, both periodic images' ends), twice
    the work when the halo is wide against the box. The pair of owned ``i``
    and a ghost image of ``j`` stays where ``id_i < id_j``; an atom's pair
    with its own image (``id_i == id_j``) stays where the separation, a
    lattice vector, is lexicographically positive. Both rules flip with the
    pair's ends, so exactly one side keeps each pair, on any rank count.
    """
    first, second = half.first, half.second
    i, j = ids[first], ids[second]
    ghost = second >= n_owned
    keep = ~ghost | (i < j)
    own_image = (ghost & (i == j)).nonzero().squeeze(1)  # only where the halo is wider than the box
    if own_image.numel():
        d = rows[second[own_image]] - rows[first[own_image]]
        tol = 1e-6  # a lattice vector's components are zero (to rounding) or far from it
        x, y, z = d.unbind(dim=1)
        keep[own_image] = (x > tol) | ((x.abs() <= tol) & ((y > tol) | ((y.abs() <= tol) & (z > tol))))
    ptype = half.ptype[keep].contiguous() if half.ptype is not None else None
    return HalfList(half.first[keep].contiguous(), half.second[keep].contiguous(), ptype)


def _d3_terms(rows, species, ref_weights, half: HalfList, tables: D3Tables, weight, n_owned: int, ghosts_once: bool):
    wp = warp_module()
    energies = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    forces, weight_grad = torch.zeros_like(rows), torch.zeros_like(ref_weights)
    if half.n_pairs == 0:
        return energies, forces, weight_grad
    inputs = [rows, half.first, half.second, species, wp.from_torch(ref_weights), tables.c6ref, tables.c8_over_c6, tables.r0_6]
    inputs += [tables.r0_8, tables.n_species, tables.n_ref, tables.s6, tables.s8, weight.contiguous(), n_owned, tables.cutoff**2]
    kernel = warp_kernel("d3_bj_ghosts_once" if ghosts_once else "d3_bj_half_list")
    launch(kernel, half.n_pairs, rows.device, inputs, [energies, forces, wp.from_torch(weight_grad)])
    return energies, forces, weight_grad


class _D3TwoBody(torch.autograd.Function):
    """Owned two-body energies with an analytic backward to rows and reference weights."""

    @staticmethod
    def forward(ctx, rows, ref_weights, species, half: HalfList, tables: D3Tables, n_owned: int, ghosts_once: bool):
        rows_c, w_c = rows.detach().contiguous(), ref_weights.detach().contiguous()
        weight = owned_weight(rows_c, n_owned)
        energies, forces, weight_grad = _d3_terms(rows_c, species, w_c, half, tables, weight, n_owned, ghosts_once)
        ctx.save_for_backward(rows_c, w_c, species, forces, weight_grad)
        ctx.half, ctx.tables, ctx.n_owned, ctx.ghosts_once = half, tables, n_owned, ghosts_once
        return energies[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, w, species, forces, weight_grad = ctx.saved_tensors
        scale = uniform_scale(grad)
        if scale is None:
            weight = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)])
            _, forces, weight_grad = _d3_terms(rows, species, w, ctx.half, ctx.tables, weight, ctx.n_owned, ctx.ghosts_once)
            scale = 1.0
        return -scale * forces, scale * weight_grad, None, None, None, None, None


def d3_two_body_autograd(
    rows: torch.Tensor,
    ref_weights: torch.Tensor,
    species: torch.Tensor,
    half: HalfList,
    tables: D3Tables,
    n_owned: int,
    ghosts_once: bool = False,
) -> torch.Tensor:
    """Owned two-body D3(BJ) energies (n_owned,), differentiable in ``rows`` and ``ref_weights`` (R, n_ref).

    ``ghosts_once``: ``half`` is a :func:`ghost_pairs_once` list.
    """
    return _D3TwoBody.apply(rows, ref_weights, species.to(torch.int32).contiguous(), half, tables, n_owned, ghosts_once)


def _cn_launch(name: str, rows, half: HalfList, rcov, k1: float, cutoff: float, extra_inputs: list, output: torch.Tensor) -> torch.Tensor:
    if half.n_pairs:
        launch(warp_kernel(name), half.n_pairs, rows.device, [rows, half.first, half.second, rcov, k1, cutoff**2, *extra_inputs], [output])
    return output


class _CoordinationNumbers(torch.autograd.Function):
    """D3 coordination numbers of the owned rows from a half list, with a backward kernel."""

    @staticmethod
    def forward(ctx, rows, rcov, half: HalfList, k1: float, cutoff: float, n_owned: int):
        rows_c, rcov_c = rows.detach().contiguous(), rcov.detach().contiguous()
        cn = _cn_launch("d3_cn_half_list", rows_c, half, rcov_c, k1, cutoff, [], torch.zeros_like(rcov_c))
        ctx.save_for_backward(rows_c, rcov_c)
        ctx.args, ctx.n_owned = (half, k1, cutoff), n_owned
        return cn[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, rcov = ctx.saved_tensors
        half, k1, cutoff = ctx.args
        cn_grad = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)]).contiguous()  # ghosts' CNs are not ours
        rows_grad = _cn_launch("d3_cn_backward_half_list", rows, half, rcov, k1, cutoff, [cn_grad], torch.zeros_like(rows))
        return rows_grad, None, None, None, None, None


def d3_coordination_numbers(rows: torch.Tensor, rcov: torch.Tensor, half: HalfList, k1: float, cutoff: float, n_owned: int) -> torch.Tensor:
    """Owned rows' coordination numbers (n_owned,), differentiable in ``rows``; ``rcov`` per row (R,)."""
    return _CoordinationNumbers.apply(rows, rcov, half, k1, cutoff, n_owned)
