"""Lennard-Jones 12-6 on a half list (see :mod:`.pairs` for the conventions).

Per species pair: ``a12 = 4 eps sigma^12`` and ``b6 = 4 eps sigma^6``, so
``u = a12 / r^12 - b6 / r^6 - shift`` with ``r^2`` only (no square root).
The Warp kernel runs one thread per owned row over the list grouped by that
row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .pairs import HalfList, launch, owned_weight, uniform_scale, warp_kernel

__all__ = ["LJTables", "lj_energy_forces", "lj_direct", "lj_energies_autograd"]


@dataclass(frozen=True)
class LJTables:
    """Per species pair (flattened ``ti * T + tj``): ``a12``, ``b6`` and ``shift = u_LJ(r_c)`` (0 if unshifted); the cutoff.

    ``row_type``: the species index ``t`` of each row of the view, int32
    (None when every row is of one species: one pair type).
    """

    a12: torch.Tensor
    b6: torch.Tensor
    shift: torch.Tensor
    cutoff: float
    row_type: torch.Tensor | None = None

    @property
    def params(self) -> torch.Tensor:
        """``(a12, b6, shift)`` per pair type, ``(T * T, 3)``, as the Warp kernel reads them."""
        return torch.stack([self.a12, self.b6, self.shift], dim=1).contiguous()

    @property
    def n_types(self) -> int:
        return math.isqrt(self.a12.numel())


def _pair_types(half: HalfList, tables: LJTables) -> torch.Tensor:
    if tables.row_type is None:
        return torch.zeros_like(half.second, dtype=torch.long)
    return (tables.row_type[half.first] * tables.n_types + tables.row_type[half.second]).long()


def _torch_kernel(rows, half: HalfList, tables: LJTables, weight, energies, forces) -> None:
    """Eager twin of the Warp kernels: the same arithmetic with a mask instead of a branch."""
    first, second = half.first.long(), half.second.long()
    d = rows[second] - rows[first]
    r2 = (d * d).sum(dim=1)
    inside = r2 <= tables.cutoff**2
    inv2 = torch.where(inside, 1.0 / r2, torch.zeros_like(r2))
    inv6 = inv2 * inv2 * inv2
    t = _pair_types(half, tables)
    a12, b6 = tables.a12[t], tables.b6[t]
    half_u = torch.where(inside, 0.5 * ((a12 * inv6 - b6) * inv6 - tables.shift[t]), torch.zeros_like(r2))
    energies.index_add_(0, first, half_u).index_add_(0, second, half_u)
    c = 0.5 * (weight[first] + weight[second])
    f = (c * (12.0 * a12 * inv6 - 6.0 * b6) * inv6 * inv2)[:, None] * d
    forces.index_add_(0, second, f).index_add_(0, first, -f)


def _kernel_inputs(rows, half: HalfList, tables: LJTables, n_owned: int) -> tuple[bool, list]:
    """Whether the tables hold one pair type, and the inputs every Warp LJ kernel starts with."""
    single = tables.row_type is None
    grouped = half.grouped(n_owned)
    row_type = grouped.second if single else tables.row_type  # unread with one type
    return single, [rows, grouped.start, grouped.second, row_type, tables.n_types, tables.params]


def lj_energy_forces(rows: torch.Tensor, half: HalfList, tables: LJTables, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row energies (R,) and forces (R, 3) = ``-d(sum_i weight_i e_i)/d(rows)``."""
    rows = rows.detach().contiguous()
    energies = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    forces = torch.zeros_like(rows)
    if not half.n_pairs:
        return energies, forces
    n_owned = int(half.first.max()) + 1 if half.start is None else half.start.numel() - 1
    single, inputs = _kernel_inputs(rows, half, tables, n_owned)
    # Warp kernels are float64; float32 runs eager
    kernel = warp_kernel("lj_owned_rows" + ("_single_type" if single else "")) if rows.dtype == torch.float64 else None
    if kernel is None:
        _torch_kernel(rows, half, tables, weight, energies, forces)
    else:
        launch(kernel, n_owned, rows.device, [*inputs, weight.contiguous(), tables.cutoff**2], [energies, forces])
    return energies, forces


def lj_direct(
    rows: torch.Tensor, half: HalfList, tables: LJTables, n_owned: int, energy: bool = True, virial: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Energies (R,) and forces (R, 3) of every row from the listed pairs, and their virial (3, 3).

    ``half`` is grouped by the ``n_owned`` owned rows. Each listed pair
    counts whole: its force on both ends, half its energy to each. Over a
    one-holder list (:attr:`~halopipe.models.LocalView.one_holder_pairs`:
    each pair of the system in one list only, LAMMPS's ``newton on``) the
    ghost rows' values are the shares of atoms owned elsewhere, which the
    caller folds home; the virial ``sum_rows r (x) F`` is then this list's
    share of the total. ``energy`` or ``virial`` False skips that work and
    returns None in its place (LAMMPS's ``eflag`` / ``vflag``); the forces
    are the same either way.
    """
    rows = rows.detach().contiguous()
    kernels = warp_kernel("LJ_DIRECT")
    forces = torch.zeros_like(rows)  # every row: the kernel writes ghost ends too rather than branch on them
    if kernels is None or rows.dtype != torch.float64 or not half.n_pairs:
        energies = rows.new_zeros(rows.shape[0])
        if half.n_pairs:
            _torch_kernel(rows, half, tables, rows.new_ones(rows.shape[0]), energies, forces)
    else:
        single, inputs = _kernel_inputs(rows, half, tables, n_owned)
        energies = rows.new_zeros(rows.shape[0] if energy else 0)  # no energies wanted: the kernel writes none
        launch(kernels[single, energy], n_owned, rows.device, [*inputs, tables.cutoff**2], [energies, forces])
    w = _pairs_virial(rows, forces, n_owned) if virial else None
    return (energies if energy else None), forces, w


def _pairs_virial(rows: torch.Tensor, forces: torch.Tensor, n_owned: int) -> torch.Tensor:
    """``sum (r - c) (x) F`` over the rows, about the owned centre ``c`` (pair forces: the sum of ``r_ab (x) f_b``).

    Written as ``sum r (x) F - c (x) sum F`` (no pass that shifts every row);
    the second term removes the origin dependence that the rounding of
    ``sum F`` would otherwise leave.
    """
    centre = rows[:n_owned].mean(dim=0) if n_owned else rows.new_zeros(3)
    return rows.T @ forces - torch.outer(centre, forces.sum(dim=0))


class _LJEnergies(torch.autograd.Function):
    """Owned energies with an analytic backward (the kernel's forces)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, half: HalfList, tables: LJTables, n_owned: int) -> torch.Tensor:
        energies, forces = lj_energy_forces(rows, half, tables, owned_weight(rows, n_owned))
        ctx.save_for_backward(rows, forces)
        ctx.half, ctx.tables, ctx.n_owned = half, tables, n_owned
        return energies[:n_owned]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, forces = ctx.saved_tensors
        scale = uniform_scale(grad)
        if scale is not None:
            return -scale * forces, None, None, None
        weight = torch.cat([grad, grad.new_zeros(rows.shape[0] - ctx.n_owned)])
        return -lj_energy_forces(rows, ctx.half, ctx.tables, weight)[1], None, None, None


def lj_energies_autograd(rows: torch.Tensor, half: HalfList, tables: LJTables, n_owned: int) -> torch.Tensor:
    """Owned energies (n_owned,), differentiable with respect to ``rows``."""
    return _LJEnergies.apply(rows, half, tables, n_owned)
