"""Real-space Ewald sum on a half list: ``u = k_e q_a q_b erfc(alpha r) / r``.

The damped Coulomb pair kernel of :mod:`.coulomb` without shift or slope
(see :mod:`.pairs` for the half-list conventions). Charges are a wired field
(a charge model produces them), so the kernel also returns ``dE/dq`` per row
and the autograd function passes it back to the charges: the chain term
``dE/dq dq/dr`` of a wired group stays exact.
"""

from __future__ import annotations

import torch

from .coulomb import DampedCoulomb, coulomb_energies_autograd, coulomb_terms
from .pairs import HalfList

__all__ = ["real_space_terms", "real_space_energies_autograd"]


def real_space_terms(
    rows: torch.Tensor, charges: torch.Tensor, half: HalfList, cutoff: float, alpha: float, coulomb: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row energies (R,), forces (R, 3) and ``dE/dq`` (R,) of the weighted real-space energy."""
    return coulomb_terms(rows, charges, half, DampedCoulomb(cutoff, alpha, coulomb), weight)


def real_space_energies_autograd(
    rows: torch.Tensor, charges: torch.Tensor, half: HalfList, cutoff: float, alpha: float, coulomb: float, n_owned: int
) -> torch.Tensor:
    """Owned real-space energies (n_owned,), differentiable with respect to ``rows`` and ``charges`` (all rows)."""
    return coulomb_energies_autograd(rows, charges, half, DampedCoulomb(cutoff, alpha, coulomb), n_owned)
