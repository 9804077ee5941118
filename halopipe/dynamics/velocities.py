"""Initial velocities from a Maxwell-Boltzmann distribution, the same on any rank count.

Each Cartesian velocity component is Gaussian with variance ``kB T / m``.
The Gaussians come from the counter-based generator keyed by the atom's
global id (:mod:`halopipe.dynamics.random`), so the velocity an atom gets does
not depend on which rank holds it. Afterwards the centre-of-mass velocity is
removed (total momentum zero) and, optionally, all velocities are scaled so
that the instantaneous temperature equals the target exactly, counting
``3N - 3`` degrees of freedom once the momentum is removed.

Only global sums cross ranks (``reduce``); everything else is per owned atom.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .random import VELOCITIES, gaussian
from .units import KB, KINETIC

__all__ = ["maxwell_boltzmann", "degrees_of_freedom", "kinetic_energy"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def degrees_of_freedom(n_total: int, momentum_conserved: bool) -> int:
    """``3N - 3`` when total momentum is zero and conserved, else ``3N`` (never below zero)."""
    return max(3 * n_total - (3 if momentum_conserved and n_total > 1 else 0), 0)


def kinetic_energy(masses: torch.Tensor, velocities: torch.Tensor, reduce: Reduce = _identity) -> torch.Tensor:
    """Total kinetic energy in eV of velocities in Å/fs and masses in amu (global with ``reduce``)."""
    local = 0.5 * (masses[:, None] * velocities * velocities).sum() * KINETIC
    return reduce(local.reshape(1)).reshape(())


def maxwell_boltzmann(
    masses: torch.Tensor,
    ids: torch.Tensor,
    temperature_K: float,
    seed: int = 0,
    *,
    reduce: Reduce = _identity,
    zero_momentum: bool = True,
    exact: bool = True,
) -> torch.Tensor:
    """Velocities (Å/fs) of the given atoms at ``temperature_K``.

    Parameters
    ----------
    masses : (n,) masses of this rank's atoms, amu.
    ids : (n,) their global ids (the noise is keyed by them).
    temperature_K : target temperature, K (>= 0).
    seed : generator seed.
    reduce : sum over ranks of a tensor (identity on one process); called
        collectively the same number of times on every rank.
    zero_momentum : remove the centre-of-mass velocity.
    exact : scale so the temperature (with ``3N - 3`` degrees of freedom when
        the momentum is removed) is exactly ``temperature_K``.
    """
    if not temperature_K >= 0:
        raise ValueError(f"maxwell_boltzmann: temperature must be >= 0 K, got {temperature_K}")
    dtype = masses.dtype
    sigma = torch.sqrt(KB * temperature_K / (masses * KINETIC))  # Å/fs
    v = gaussian(seed, 0, ids, 3, stream=VELOCITIES, dtype=dtype) * sigma[:, None]
    totals = reduce(torch.cat([(masses[:, None] * v).sum(0), masses.sum().reshape(1), masses.new_tensor([len(ids)])]))
    n_total = int(round(float(totals[4])))
    if zero_momentum:
        v = v - totals[:3] / totals[3]
    if exact:
        dof = degrees_of_freedom(n_total, zero_momentum)
        ke = kinetic_energy(masses, v, reduce)
        target = 0.5 * dof * KB * temperature_K
        scale = torch.sqrt(target / ke) if float(ke) > 0 else ke.new_zeros(())
        v = v * scale
    return v
