"""Lennard-Jones 12-6 pair potential.

``u(r) = 4 eps [(sigma/r)^12 - (sigma/r)^6] - u(r_c)`` (shifted to zero at the
cutoff when ``shift=True``). Parameters are per species pair; unlike pairs are
mixed by Lorentz-Berthelot (``sigma_ij = (sigma_i + sigma_j)/2``,
``eps_ij = sqrt(eps_i eps_j)``) unless given explicitly. Each directed pair
``(i, j)`` with owned ``i`` gives half its energy to atom ``i``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .base import LocalView, Model, ModelOutput, check_positive_length

__all__ = ["LennardJones"]

_N_SPECIES = 119


def _pair_table(value, name: str, mix) -> tuple[torch.Tensor, torch.Tensor]:
    """(119, 119) table of a pair parameter and a mask of defined entries."""
    table = torch.zeros(_N_SPECIES, _N_SPECIES, dtype=torch.float64)
    known = torch.zeros(_N_SPECIES, _N_SPECIES, dtype=torch.bool)
    if isinstance(value, (int, float)):
        table[:] = float(value)
        known[:] = True
        return table, known
    if not isinstance(value, Mapping):
        raise TypeError(f"LennardJones: {name} must be a number or a mapping, got {type(value).__name__}")
    singles = {int(k): float(v) for k, v in value.items() if not isinstance(k, tuple)}
    for zi, vi in singles.items():
        for zj, vj in singles.items():
            table[zi, zj] = mix(vi, vj)
            known[zi, zj] = True
    for key, v in value.items():
        if isinstance(key, tuple):
            zi, zj = int(key[0]), int(key[1])
            table[zi, zj] = table[zj, zi] = float(v)
            known[zi, zj] = known[zj, zi] = True
    return table, known


class LennardJones(Model):
    """Lennard-Jones potential with per-species-pair parameters.

    Parameters
    ----------
    epsilon, sigma : a number (all pairs), or a mapping from atomic number to
        a per-species value (mixed by Lorentz-Berthelot), optionally with
        ``(Z1, Z2)`` keys giving a pair value explicitly. eV and Å.
    cutoff : Å.
    shift : shift each pair energy to zero at the cutoff (as ASE does).
    """

    direct_forces = True

    def __init__(self, epsilon=0.0103, sigma=3.4, cutoff: float = 8.5, shift: bool = True) -> None:
        super().__init__()
        cutoff = check_positive_length("LennardJones", "cutoff", cutoff)
        eps, k1 = _pair_table(epsilon, "epsilon", lambda a, b: math.sqrt(a * b))
        sig, k2 = _pair_table(sigma, "sigma", lambda a, b: 0.5 * (a + b))
        if not (torch.isfinite(eps).all() and torch.isfinite(sig).all()) or (eps < 0).any() or (sig[k2] <= 0).any():
            raise ValueError(f"LennardJones: need finite epsilon >= 0 and sigma > 0, got epsilon={epsilon}, sigma={sigma}")
        self.cutoff = float(cutoff)
        self.shift = bool(shift)
        self.register_buffer("epsilon", eps)
        self.register_buffer("sigma", sig)
        self.register_buffer("known", k1 & k2)

    def _params(self, view: LocalView):
        zi, zj = view.numbers[view.pairs[0]], view.numbers[view.pairs[1]]
        if not bool(self.known[zi, zj].all()):
            bad = (~self.known[zi, zj]).nonzero()[0]
            raise ValueError(f"LennardJones: no parameters for the species pair ({int(zi[bad])}, {int(zj[bad])})")
        dtype = view.positions.dtype
        return self.epsilon[zi, zj].to(dtype), self.sigma[zi, zj].to(dtype)

    def pair_energy(self, r: torch.Tensor, eps: torch.Tensor, sig: torch.Tensor) -> torch.Tensor:
        s6 = (sig / r) ** 6
        u = 4.0 * eps * (s6 * s6 - s6)
        if self.shift:
            c6 = (sig / self.cutoff) ** 6
            u = u - 4.0 * eps * (c6 * c6 - c6)
        return u

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        eps, sig = self._params(view)
        r = view.distances
        u = self.pair_energy(r, eps, sig)
        energies = torch.zeros(view.n_owned, dtype=r.dtype, device=r.device).index_add(0, view.pairs[0], 0.5 * u)
        if not direct:
            return ModelOutput(energies=energies)
        # du/dr = 4 eps (-12 s^12 + 6 s^6) / r
        s6 = (sig / r) ** 6
        du = 4.0 * eps * (-12.0 * s6 * s6 + 6.0 * s6) / r
        # Directed pair (i, j) carries u/2: force on i is +du/2 * r_hat, on j the opposite.
        fpair = (0.5 * du / r)[:, None] * view.vectors
        forces = torch.zeros_like(view.positions)
        forces.index_add_(0, view.pairs[0], fpair)
        forces.index_add_(0, view.pairs[1], -fpair)
        virial = -(view.vectors.transpose(0, 1) @ fpair)
        return ModelOutput(energies=energies, forces=forces, virial=virial)
