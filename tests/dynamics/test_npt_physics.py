"""Physical validation of the MTK barostat: the Lennard-Jones fluid's equation of state.

Reference: the equation of state of Johnson, Zollweg & Gubbins (1993), fitted to simulations of the full LJ
fluid (tests/dynamics/_lj_eos.py). The simulated fluid is cut at 2.5 sigma with no tail correction, so the
reference density is the root of ``P_JZG(rho) - P_tail(rho) = P`` (the tail beyond the cutoff with g(r) = 1).
The NPT mean density must agree within three standard errors (10 block averages) plus 1.5 %, the EOS's own
accuracy together with the tail approximation and the finite size (108 atoms).
Measured with these settings: T* = 1.5, P* = 2: 0.6885 +- 0.0064 against 0.6907; T* = 2, P* = 3: 0.6754 +- 0.0053
against 0.6660 (about 62 s for both on one core).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ase import units
from ase.build import bulk

from halopipe import LennardJones, Pipeline, System
from halopipe.distributed import DomainConfig
from halopipe.dynamics import IsotropicMTKNPT, Simulation, StochasticCellRescaling
from halopipe.dynamics.barostats import BAR_TO_EV_PER_A3

from ._lj_eos import density

EPSILON, SIGMA, MASS = 0.0104, 3.4, 39.948
TAU = SIGMA * math.sqrt(MASS / EPSILON) / units.fs  # the LJ time unit, fs


def _npt_density(t_star: float, p_star: float, steps: int, kind: str = "mtk", blocks: int = 10) -> tuple[float, float]:
    """Mean reduced density and its standard error from an NPT run of 108 LJ atoms started at the EOS density."""
    start = density(p_star, t_star, 2.5)
    atoms = bulk("Ar", "fcc", a=(4.0 / start) ** (1.0 / 3.0) * SIGMA, cubic=True).repeat((3, 3, 3))
    dt = 0.004 * TAU
    temperature = t_star * EPSILON / units.kB
    pressure = p_star * EPSILON / SIGMA**3 / BAR_TO_EV_PER_A3
    model = LennardJones(epsilon=EPSILON, sigma=SIGMA, cutoff=2.5 * SIGMA)
    if kind == "csr":  # compressibility: about the LJ fluid's there, kT/(V dP/drho) ~ 0.1 sigma³/epsilon
        beta = 0.1 * SIGMA**3 / EPSILON * BAR_TO_EV_PER_A3
        integrator = StochasticCellRescaling(dt, temperature, pressure, compressibility=beta, taup=200 * dt, friction=0.02 / dt, seed=2)
    else:
        integrator = IsotropicMTKNPT(dt, temperature, pressure, tdamp=100 * dt, pdamp=400 * dt)
    sim = Simulation(Pipeline([model], config=DomainConfig(skin=0.3 * SIGMA)), System.from_ase(atoms), integrator)
    sim.set_velocities(temperature, seed=1)
    sim.run(steps // 5)  # equilibration
    rho = []
    for _ in range(steps):
        sim.run(1)
        rho.append(len(atoms) * SIGMA**3 / float(torch.linalg.det(sim.sharded.cell)))
    means = np.asarray(rho[: steps // blocks * blocks]).reshape(blocks, -1).mean(axis=1)
    return float(means.mean()), float(means.std(ddof=1) / math.sqrt(blocks))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("t_star, p_star, kind", [(1.5, 2.0, "mtk"), (2.0, 3.0, "mtk"), (1.5, 2.0, "csr")])
def test_lj_density_matches_the_johnson_zollweg_gubbins_eos(t_star, p_star, kind):
    expected = density(p_star, t_star, 2.5)
    mean, error = _npt_density(t_star, p_star, steps=2500, kind=kind)
    print(f"{kind}: T* = {t_star}, P* = {p_star}: rho* = {mean:.4f} +- {error:.4f} (EOS, cut at 2.5 sigma: {expected:.4f})")
    assert abs(mean - expected) < 3 * error + 0.015 * expected
