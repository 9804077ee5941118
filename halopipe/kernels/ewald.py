"""Real-space Ewald sum on a half list: ``u = k_e q_a q_b erfc(alpha r) / r`` (see :mod:`.pairs`).

Charges are a wired field (a charge model produces them), so the kernel also
returns ``dE/dq`` per row: ``sum_b c_ab k_e q_b erfc(alpha r) / r`` with the
pair weight ``c_ab``. The autograd function passes it back to the charges,
so the chain term ``dE/dq dq/dr`` of a wired group stays exact.
"""

from __future__ import annotations

import math

import torch

from .pairs import HalfList, launch, owned_weight, uniform_scale, warp_kernel

__all__ = ["real_space_terms", "real_space_energies_autograd"]


def _torch_kernel(rows, charges, half: HalfList, cutoff: float, alpha: float, coulomb: float, weight, energies, forces, charge_grad):
    """Eager twin of the Warp kernel."""
    a, b = half.first.long(), half.second.long()
    d = rows[b] - rows[a]
    r2 = (d * d).sum(dim=1)
    inside = r2 <= cutoff**2
    r = torch.where(inside, r2, torch.ones_like(r2)).sqrt()
    screened = torch.where(inside, coulomb * torch.erfc(alpha * r) / r, torch.zeros_like(r))
    qa, qb = charges[a], charges[b]
    half_u = 0.5 * qa * qb * screened
    energies.index_add_(0, a, half_u).index_add_(0, b, half_u)
    c = 0.5 * (weight[a] + weight[b])
    charge_grad.index_add_(0, a, c * qb * screened).index_add_(0, b, c * qa * screened)
    gauss = coulomb * (2.0 / math.sqrt(math.pi)) * alpha * torch.exp(-alpha * alpha * r2)
    f = torch.where(inside, c * qa * qb * (screened + gauss) / r2, torch.zeros_like(r))[:, None] * d
    forces.index_add_(0, b, f).index_add_(0, a, -f)


def real_space_terms(
    rows: torch.Tensor, charges: torch.Tensor, half: HalfList, cutoff: float, alpha: float, coulomb: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row energies (R,), forces (R, 3) and ``dE/dq`` (R,) of the weighted real-space energy."""
    rows, charges = rows.detach().contiguous(), charges.detach().to(rows.dtype).contiguous()
    energies = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    forces, charge_grad = torch.zeros_like(rows), torch.zeros_like(energies)
    if half.n_pairs == 0:
        return energies, forces, charge_grad
    kernel = warp_kernel("ewald_real_half_list") if rows.dtype == torch.float64 else None
    if kernel is None:
        _torch_kernel(rows, charges, half, cutoff, alpha, coulomb, weight, energies, forces, charge_grad)
        return energies, forces, charge_grad
    inputs = [rows, half.first, half.second, charges, weight.contiguous(), cutoff**2, alpha, coulomb]
    launch(kernel, half.n_pairs, rows.device, inputs, [energies, forces, charge_grad])
    return energies, forces, charge_grad


class _RealSpace(torch.autograd.Function):
    """Owned real-space energies with an analytic backward to rows and charges."""

    @staticmethod
    def forward(ctx, rows, charges, half: HalfList, cutoff: float, alpha: float, coulomb: float, n_owned: int):
        energies, forces, charge_grad = real_space_terms(rows, charges, half, cutoff, alpha, coulomb, owned_weight(rows, n_owned))
        ctx.save_for_backward(rows, charges, forces, charge_grad)
        ctx.args = (half, cutoff, alpha, coulomb)
        ctx.n_owned = n_owned
        return energies[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, charges, forces, charge_grad = ctx.saved_tensors
        scale = uniform_scale(grad)
        if scale is None:
            weight = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)])
            _, weighted, weighted_q = real_space_terms(rows, charges, *ctx.args, weight)
            return -weighted, weighted_q.to(charges.dtype), None, None, None, None, None
        return -scale * forces, (scale * charge_grad).to(charges.dtype), None, None, None, None, None


def real_space_energies_autograd(
    rows: torch.Tensor, charges: torch.Tensor, half: HalfList, cutoff: float, alpha: float, coulomb: float, n_owned: int
) -> torch.Tensor:
    """Owned real-space energies (n_owned,), differentiable with respect to ``rows`` and ``charges`` (all rows)."""
    return _RealSpace.apply(rows, charges, half, cutoff, alpha, coulomb, n_owned)
