"""Damped shifted-force (DSF) Coulomb electrostatics.

Fennell and Gezelter, J. Chem. Phys. 124, 234104 (2006), eq. 19: a pairwise
electrostatic sum in which both the damped potential and its force go
smoothly to zero at the cutoff ``R_c``::

    E = k sum_{i<j} q_i q_j [ erfc(a r)/r - erfc(a R_c)/R_c
                              + (erfc(a R_c)/R_c^2 + 2a/sqrt(pi) exp(-a^2 R_c^2)/R_c) (r - R_c) ]
        - k sum_i q_i^2 [ erfc(a R_c)/(2 R_c) + a/sqrt(pi) ]

It consumes the per-atom field ``charges`` (static, or wired from a charge
model with its graph). The pair sum runs in a compiled half-list kernel
(:mod:`halopipe.kernels.coulomb`, shared with Ewald's real space) that returns
energies, forces and ``dE/dq`` in one pass: with static charges the model gives
direct forces; in an autograd group an analytic backward carries ``dE/dq`` to
the charge model, so the wired chain term stays exact. Each pair of the system
is evaluated once (:attr:`~halopipe.models.LocalView.one_holder_pairs`), its
ghost end's share folded home.
"""

from __future__ import annotations

import math

from ..kernels.coulomb import DampedCoulomb, coulomb_energies_autograd, coulomb_terms
from ..kernels.pairs import HalfListCache
from .base import (
    LocalView,
    Model,
    ModelOutput,
    add_to_owned,
    check_positive_length,
    fold_ghost_shares,
    pair_energies_once,
    virial_from_forces,
)

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
    direct_forces = True
    ghost_forces = False  # direct forces come back complete on owned rows: the model folds its ghost shares itself
    half_list = True
    one_holder_list = True
    batchable = True

    def __init__(self, cutoff: float = 10.0, alpha: float = 0.2) -> None:
        super().__init__()
        cutoff = check_positive_length("DSFCoulomb", "cutoff", cutoff)
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"DSFCoulomb: alpha must be a finite number >= 0 (1/Å), got {alpha!r}")
        self.cutoff, self.alpha = cutoff, float(alpha)
        a, rc = self.alpha, self.cutoff
        shift = math.erfc(a * rc) / rc
        slope = math.erfc(a * rc) / rc**2 + 2 * a / math.sqrt(math.pi) * math.exp(-((a * rc) ** 2)) / rc
        self._pair = DampedCoulomb(rc, a, COULOMB_CONSTANT, shift, slope)
        self._self = math.erfc(a * rc) / (2 * rc) + a / math.sqrt(math.pi)
        self._half = HalfListCache()

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        q = view.fields["charges"].to(view.positions.dtype)
        n = view.n_owned
        self_energies = (-COULOMB_CONSTANT * self._self) * q[:n] * q[:n]
        if not direct:
            pairs = pair_energies_once(view, self._half, lambda half, m: coulomb_energies_autograd(view.positions, q, half, self._pair, m))
            return ModelOutput(energies=add_to_owned(pairs, self_energies))
        once = self._half.get(view, one_holder=True)
        energies, forces, _ = coulomb_terms(view.positions, q, once, self._pair, view.positions.new_ones(view.n_rows), charge_grad=False)
        # Centred rows: the same virial (forces sum to zero) with less cancellation far from the origin.
        centre = view.positions[:n].mean(dim=0) if n else view.positions.new_zeros(3)
        virial = virial_from_forces(view.positions - centre, forces)
        forces, energies = fold_ghost_shares(view, forces, energies if view.need_energy else None)
        return ModelOutput(energies=None if energies is None else energies + self_energies, forces=forces, virial=virial)
