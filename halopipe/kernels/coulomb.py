"""Damped, shifted Coulomb pairs on a half list: one kernel for DSF electrostatics and Ewald's real-space sum.

Within the cutoff ``r_c`` a pair contributes
``u = k_e q_a q_b [erfc(alpha r) / r - shift + slope (r - r_c)]``:
Ewald's real-space term has ``shift = slope = 0``; the damped shifted force
sum of Fennell and Gezelter shifts both the potential and the force to zero
at ``r_c`` (:class:`~halopipe.models.DSFCoulomb`). Charges may be a wired
field, so the kernel also returns ``dE/dq`` per row,
``sum_b c_ab q_b u_ab / (q_a q_b)`` with the pair weight ``c_ab`` (see
:mod:`.pairs`); the autograd function hands it back to the charges, so the
chain term ``dE/dq dq/dr`` of a wired group stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .pairs import HalfList, launch, owned_weight, uniform_scale, warp_kernel

__all__ = ["DampedCoulomb", "coulomb_terms", "coulomb_energies_autograd"]


@dataclass(frozen=True)
class DampedCoulomb:
    """Pair parameters: cutoff (Å), damping ``alpha`` (1/Å), Coulomb constant ``coulomb`` (eV Å/e²), ``shift`` (1/Å), ``slope`` (1/Å²)."""

    cutoff: float
    alpha: float
    coulomb: float
    shift: float = 0.0
    slope: float = 0.0


def _torch_kernel(rows, charges, half: HalfList, p: DampedCoulomb, weight, energies, forces, charge_grad) -> None:
    """Eager twin of the Warp kernel: the same arithmetic with a mask instead of an early return."""
    a, b = half.first.long(), half.second.long()
    d = rows[b] - rows[a]
    r2 = (d * d).sum(dim=1)
    inside = r2 <= p.cutoff * p.cutoff
    r = torch.where(inside, r2, torch.ones_like(r2)).sqrt()
    screened = p.coulomb * torch.erfc(p.alpha * r) / r
    pair = torch.where(inside, screened - p.coulomb * p.shift + p.coulomb * p.slope * (r - p.cutoff), torch.zeros_like(r))
    qa, qb = charges[a], charges[b]
    half_u = 0.5 * qa * qb * pair
    energies.index_add_(0, a, half_u).index_add_(0, b, half_u)
    c = 0.5 * (weight[a] + weight[b])
    charge_grad.index_add_(0, a, c * qb * pair).index_add_(0, b, c * qa * pair)
    gauss = p.coulomb * (2.0 / math.sqrt(math.pi)) * p.alpha * torch.exp(-p.alpha * p.alpha * r2)
    f = torch.where(inside, c * qa * qb * ((screened + gauss) / r2 - p.coulomb * p.slope / r), torch.zeros_like(r))[:, None] * d
    forces.index_add_(0, b, f).index_add_(0, a, -f)


def coulomb_terms(
    rows: torch.Tensor, charges: torch.Tensor, half: HalfList, pair: DampedCoulomb, weight: torch.Tensor, charge_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row energies (R,), forces (R, 3) = ``-d(sum_i weight_i e_i)/d(rows)`` and ``d(sum_i weight_i e_i)/dq`` (R,).

    ``charge_grad`` False: the charges need no gradient (fixed charges), and
    None comes back in its place.
    """
    rows, charges = rows.detach().contiguous(), charges.detach().to(rows.dtype).contiguous()
    energies = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    forces, grad = torch.zeros_like(rows), torch.zeros_like(energies)
    name = "damped_coulomb_grouped" + ("" if charge_grad else "_fixed_charges")
    kernel = warp_kernel(name, "_warp_electrostatics") if rows.dtype == torch.float64 and half.n_pairs else None
    if kernel is not None:
        half = half.grouped(rows.shape[0])  # a thread per row (a domain's lists come grouped: no cost)
        k_shift, k_slope = pair.coulomb * pair.shift, pair.coulomb * pair.slope
        inputs = [rows, half.start, half.second, charges, weight.contiguous(), pair.cutoff, pair.alpha, pair.coulomb, k_shift, k_slope]
        launch(kernel, half.start.numel() - 1, rows.device, inputs, [energies, forces, grad if charge_grad else grad[:0]])
    elif half.n_pairs:
        _torch_kernel(rows, charges, half, pair, weight, energies, forces, grad)
    return energies, forces, grad if charge_grad else None


class _CoulombEnergies(torch.autograd.Function):
    """Owned pair energies with an analytic backward to rows and charges (to charges only when they need it)."""

    @staticmethod
    def forward(ctx, rows, charges, half: HalfList, pair: DampedCoulomb, n_owned: int):
        wants_q = ctx.needs_input_grad[1]
        energies, forces, charge_grad = coulomb_terms(rows, charges, half, pair, owned_weight(rows, n_owned), wants_q)
        ctx.save_for_backward(rows, charges, forces, charge_grad)
        ctx.half, ctx.pair, ctx.n_owned = half, pair, n_owned
        return energies[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, charges, forces, charge_grad = ctx.saved_tensors
        scale = uniform_scale(grad)
        if scale is None:  # per-atom weights: one more kernel pass with them
            weight = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)])
            _, forces, charge_grad = coulomb_terms(rows, charges, ctx.half, ctx.pair, weight, charge_grad is not None)
            scale = 1.0
        return -scale * forces, None if charge_grad is None else (scale * charge_grad).to(charges.dtype), None, None, None


def coulomb_energies_autograd(rows: torch.Tensor, charges: torch.Tensor, half: HalfList, pair: DampedCoulomb, n_owned: int) -> torch.Tensor:
    """Owned pair energies (n_owned,), differentiable with respect to ``rows`` and ``charges`` (all rows)."""
    return _CoulombEnergies.apply(rows, charges, half, pair, n_owned)
