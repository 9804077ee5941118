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

__all__ = ["D3Tables", "d3_kernel_available", "d3_two_body_autograd", "d3_coordination_numbers"]


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


def _d3_terms(rows, species, ref_weights, half: HalfList, tables: D3Tables, weight):
    wp = warp_module()
    energies = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    forces, weight_grad = torch.zeros_like(rows), torch.zeros_like(ref_weights)
    if half.n_pairs == 0:
        return energies, forces, weight_grad
    inputs = [rows, half.first, half.second, species, wp.from_torch(ref_weights), tables.c6ref, tables.c8_over_c6, tables.r0_6]
    inputs += [tables.r0_8, tables.n_species, tables.n_ref, tables.s6, tables.s8, weight.contiguous(), tables.cutoff**2]
    launch(warp_kernel("d3_bj_half_list"), half.n_pairs, rows.device, inputs, [energies, forces, wp.from_torch(weight_grad)])
    return energies, forces, weight_grad


class _D3TwoBody(torch.autograd.Function):
    """Owned two-body energies with an analytic backward to rows and reference weights."""

    @staticmethod
    def forward(ctx, rows, ref_weights, species, half: HalfList, tables: D3Tables, n_owned: int):
        rows_c, w_c = rows.detach().contiguous(), ref_weights.detach().contiguous()
        energies, forces, weight_grad = _d3_terms(rows_c, species, w_c, half, tables, owned_weight(rows_c, n_owned))
        ctx.save_for_backward(rows_c, w_c, species, forces, weight_grad)
        ctx.half, ctx.tables, ctx.n_owned = half, tables, n_owned
        return energies[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, w, species, forces, weight_grad = ctx.saved_tensors
        scale = uniform_scale(grad)
        if scale is None:
            weight = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)])
            _, forces, weight_grad = _d3_terms(rows, species, w, ctx.half, ctx.tables, weight)
            scale = 1.0
        return -scale * forces, scale * weight_grad, None, None, None, None


def d3_two_body_autograd(
    rows: torch.Tensor, ref_weights: torch.Tensor, species: torch.Tensor, half: HalfList, tables: D3Tables, n_owned: int
) -> torch.Tensor:
    """Owned two-body D3(BJ) energies (n_owned,), differentiable in ``rows`` and ``ref_weights`` (R, n_ref)."""
    return _D3TwoBody.apply(rows, ref_weights, species.to(torch.int32).contiguous(), half, tables, n_owned)


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
