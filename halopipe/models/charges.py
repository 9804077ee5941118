"""A small differentiable charge model.

Each atom's raw charge comes from its species and a smooth coordination
number, ``q_i = chi_Z - w_Z * CN_i`` with ``CN_i = sum_j f_c(r_ij)`` and the
cosine cutoff ``f_c(r) = (1 + cos(pi r / r_c)) / 2``. The total charge is then
imposed exactly by a uniform global correction (as AIMNet2-style models do)::

    q_i <- q_i - (sum_j q_j - Q) / N

The sum over all atoms goes through ``view.global_sum``, so the correction is
global under domain decomposition and every charge depends, through it, on
every position: the chain term ``dE/dq * dq/dr`` reaches across ranks.
Optionally the model adds a charge self-energy ``e_i = J_Z q_i^2 / 2``.
Coordination numbers come from a compiled half-list kernel with an analytic
backward (:mod:`halopipe.kernels.charges`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..kernels.charges import coordination_autograd
from ..kernels.pairs import HalfListCache
from .base import LocalView, Model, ModelOutput, check_positive_length

__all__ = ["ChargeModel", "PAULING_ELECTRONEGATIVITY"]

# Pauling electronegativities of common elements (default raw-charge scale).
PAULING_ELECTRONEGATIVITY = {
    1: 2.20,
    3: 0.98,
    4: 1.57,
    5: 2.04,
    6: 2.55,
    7: 3.04,
    8: 3.44,
    9: 3.98,
    11: 0.93,
    12: 1.31,
    13: 1.61,
    14: 1.90,
    15: 2.19,
    16: 2.58,
    17: 3.16,
    19: 0.82,
    20: 1.00,
    26: 1.83,
    29: 1.90,
    30: 1.65,
    35: 2.96,
    37: 0.82,
    38: 0.95,
    53: 2.66,
    55: 0.79,
    56: 0.89,
}


def _species_table(values: Mapping[int, float] | None, default: Mapping[int, float] | float) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.zeros(119, dtype=torch.float64)
    known = torch.zeros(119, dtype=torch.bool)
    source = dict(default) if isinstance(default, Mapping) else {z: float(default) for z in range(1, 119)}
    source.update({int(k): float(v) for k, v in (values or {}).items()})
    for z, v in source.items():
        table[z], known[z] = v, True
    return table, known


class ChargeModel(Model):
    """Charges from species and coordination, with an exact total charge.

    Parameters
    ----------
    cutoff : coordination cutoff, Å.
    electronegativity : per-species raw charge offsets ``chi_Z``; default
        ``-0.5 * (Pauling_Z - 2.2)`` for the elements in
        :data:`PAULING_ELECTRONEGATIVITY`.
    coordination_weight : per-species ``w_Z`` (or one number), e/neighbour.
    total_charge : the exact total charge ``Q`` imposed, e.
    hardness : per-species ``J_Z`` of the optional self-energy (eV/e²), or one number.
    """

    outputs = frozenset({"charges"})
    half_list = True
    batchable = True

    def __init__(
        self, cutoff: float = 4.0, electronegativity=None, coordination_weight=0.02, total_charge: float = 0.0, hardness=0.0
    ) -> None:
        super().__init__()
        cutoff = check_positive_length("ChargeModel", "cutoff", cutoff)
        if not math.isfinite(float(total_charge)):
            raise ValueError(f"ChargeModel: total_charge must be a finite number (e), got {total_charge!r}")
        self.cutoff, self.total_charge = cutoff, float(total_charge)
        default_chi = {z: -0.5 * (en - 2.2) for z, en in PAULING_ELECTRONEGATIVITY.items()}
        chi, known = _species_table(electronegativity, default_chi)
        w = coordination_weight if isinstance(coordination_weight, Mapping) else None
        weight, _ = _species_table(w, 0.0 if w is not None else float(coordination_weight))
        j = hardness if isinstance(hardness, Mapping) else None
        hard, _ = _species_table(j, 0.0 if j is not None else float(hardness))
        self.register_buffer("chi", chi)
        self.register_buffer("known", known)
        self.register_buffer("weight", weight)
        self.register_buffer("hardness", hard)
        self._half = HalfListCache()

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        n = view.n_owned
        z = view.numbers[:n]
        if not bool(self.known[z].all()):
            bad = int(z[~self.known[z]][0])
            raise ValueError(f"ChargeModel: no electronegativity for atomic number {bad}; pass electronegativity={{{bad}: value}}")
        dtype = view.positions.dtype
        cn = coordination_autograd(view.positions, self._half.get(view), self.cutoff, n)
        raw = self.chi[z].to(dtype) - self.weight[z].to(dtype) * cn
        excess = view.system_sum(raw) - self.total_charge  # per system: no charge moves between systems of a batch
        system = view.owned_system()
        charges = raw - (excess / view.atoms_per_system().to(dtype))[system]
        energies = 0.5 * self.hardness[z].to(dtype) * charges * charges
        return ModelOutput(energies=energies, fields={"charges": charges})
