"""Damped shifted-force (DSF) Coulomb electrostatics.

Fennell and Gezelter, J. Chem. Phys. 124, 234104 (2006), eq. 19: a pairwise
electrostatic sum in which both the damped potential and its force go
smoothly to zero at the cutoff ``R_c``::

    E = k sum_{i<j} q_i q_j [ erfc(a r)/r - erfc(a R_c)/R_c
                              + (erfc(a R_c)/R_c^2 + 2a/sqrt(pi) exp(-a^2 R_c^2)/R_c) (r - R_c) ]
        - k sum_i q_i^2 [ erfc(a R_c)/(2 R_c) + a/sqrt(pi) ]

It consumes the per-atom field ``charges`` (static, or wired from a charge
model with its graph).
"""

from __future__ import annotations

import math

import torch

from .base import LocalView, Model, ModelOutput, check_positive_length

__all__ = ["DSFCoulomb", "COULOMB_CONSTANT"]


def _coulomb_constant() -> float:
    from ase import units

    return units.Hartree * units.Bohr  # e^2 / (4 pi eps0) in eV Å


COULOMB_CONSTANT = _coulomb_constant()


class DSFCoulomb(Model):
    """Damped shifted-force Coulomb.

    Parameters
    ----------
    cutoff : Å.
    alpha : damping parameter, 1/Å (0.2 is a common choice for 10-12 Å cutoffs).
    """

    inputs = frozenset({"charges"})

    def __init__(self, cutoff: float = 10.0, alpha: float = 0.2) -> None:
        super().__init__()
        cutoff = check_positive_length("DSFCoulomb", "cutoff", cutoff)
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"DSFCoulomb: alpha must be a finite number >= 0 (1/Å), got {alpha!r}")
        self.cutoff, self.alpha = cutoff, float(alpha)
        a, rc = self.alpha, self.cutoff
        self._erfc_rc = math.erfc(a * rc) / rc
        self._slope = math.erfc(a * rc) / rc**2 + 2 * a / math.sqrt(math.pi) * math.exp(-((a * rc) ** 2)) / rc
        self._self = math.erfc(a * rc) / (2 * rc) + a / math.sqrt(math.pi)

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        q = view.fields["charges"].to(view.positions.dtype)
        i, j = view.pairs
        r = view.distances
        pair = torch.erfc(self.alpha * r) / r - self._erfc_rc + self._slope * (r - self.cutoff)
        # Directed pairs: each unordered pair appears from both owned ends, hence the 1/2.
        e_pair = 0.5 * COULOMB_CONSTANT * q[i] * q[j] * pair
        q_owned = q[: view.n_owned]
        energies = (-COULOMB_CONSTANT * self._self) * q_owned * q_owned
        energies = energies.index_add(0, i, e_pair)
        return ModelOutput(energies=energies)
