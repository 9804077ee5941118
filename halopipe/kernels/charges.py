"""Coordination numbers with a cosine cutoff on a half list, with an analytic backward.

``CN_a = sum_b f_c(r_ab)``, ``f_c(r) = (1 + cos(pi r / r_c)) / 2`` within
``r_c`` (:class:`~halopipe.models.ChargeModel`). Each pair of the half list
(see :mod:`.pairs`) adds its count to both ends; only owned rows' numbers are
returned (a ghost's own count is its owner's business). The backward of
``sum_a g_a CN_a`` sends ``(g_a + g_b) f_c'(r) d / r`` to the ends of each pair.
"""

from __future__ import annotations

import math

import torch

from .pairs import HalfList, launch, warp_kernel

__all__ = ["coordination_numbers", "coordination_gradient", "coordination_autograd"]

_SOURCE = "_warp_electrostatics"


def _kernel(name: str, dtype: torch.dtype):
    return warp_kernel(name, _SOURCE) if dtype == torch.float64 else None


def _distances(rows: torch.Tensor, half: HalfList, cutoff: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager twin helper: pair vectors, lengths (1 outside the cutoff) and the inside mask."""
    d = rows[half.second.long()] - rows[half.first.long()]
    r2 = (d * d).sum(dim=1)
    inside = r2 <= cutoff * cutoff
    return d, torch.where(inside, r2, torch.ones_like(r2)).sqrt(), inside


def coordination_numbers(rows: torch.Tensor, half: HalfList, cutoff: float) -> torch.Tensor:
    """Cosine-cutoff coordination numbers of every row (R,); those of ghost rows are partial."""
    rows = rows.detach().contiguous()
    cn = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    if half.n_pairs == 0:
        return cn
    kernel = _kernel("cosine_coordination_rows", rows.dtype)
    if kernel is None:
        _, r, inside = _distances(rows, half, cutoff)
        count = torch.where(inside, 0.5 * (1.0 + torch.cos(math.pi * r / cutoff)), torch.zeros_like(r))
        cn.index_add_(0, half.first.long(), count).index_add_(0, half.second.long(), count)
        return cn
    half = half.grouped(rows.shape[0])  # a thread per row (a domain's lists come grouped: no cost)
    launch(kernel, half.start.numel() - 1, rows.device, [rows, half.start, half.second, cutoff], [cn])
    return cn


def coordination_gradient(rows: torch.Tensor, half: HalfList, cutoff: float, cn_grad: torch.Tensor) -> torch.Tensor:
    """``d(sum_a cn_grad_a CN_a)/d(rows)`` (R, 3) for per-row weights ``cn_grad`` (R,)."""
    rows = rows.detach().contiguous()
    grad = torch.zeros_like(rows)
    if half.n_pairs == 0:
        return grad
    kernel = _kernel("cosine_coordination_backward_rows", rows.dtype)
    if kernel is None:
        d, r, inside = _distances(rows, half, cutoff)
        a, b = half.first.long(), half.second.long()
        w = math.pi / cutoff
        g = torch.where(inside, (cn_grad[a] + cn_grad[b]) * -0.5 * w * torch.sin(w * r) / r, torch.zeros_like(r))[:, None] * d
        grad.index_add_(0, b, g).index_add_(0, a, -g)
        return grad
    half = half.grouped(rows.shape[0])
    launch(kernel, half.start.numel() - 1, rows.device, [rows, half.start, half.second, cutoff, cn_grad.contiguous()], [grad])
    return grad


class _Coordination(torch.autograd.Function):
    """Owned coordination numbers with an analytic backward to the rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, half: HalfList, cutoff: float, n_owned: int) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.half, ctx.cutoff = half, cutoff
        return coordination_numbers(rows, half, cutoff)[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        weights = torch.cat([grad, grad.new_zeros(rows.shape[0] - grad.shape[0])])
        return coordination_gradient(rows, ctx.half, ctx.cutoff, weights), None, None, None


def coordination_autograd(rows: torch.Tensor, half: HalfList, cutoff: float, n_owned: int) -> torch.Tensor:
    """Owned coordination numbers (n_owned,), differentiable with respect to ``rows``."""
    return _Coordination.apply(rows, half, cutoff, n_owned)
