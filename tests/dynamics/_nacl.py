"""A rock-salt NaCl crystal for NPT checks: the Joung-Cheatham fixed-charge model and its static E(V) curve.

The model is Joung & Cheatham's ion set for SPC/E water (J. Phys. Chem. B 112, 9020 (2008)): formal charges +-1 e
(exact Coulomb by Ewald) plus Lennard-Jones with Lorentz-Berthelot mixing. It was fitted to the NaCl crystal's
lattice constant and lattice energy, so its rock-salt crystal is stable: a0 = 5.723 Å (experiment 5.60 Å at 0 K),
lattice energy -8.21 eV per ion pair (Born-Haber: -8.15). Its 12-power repulsion is stiffer than NaCl's
exponential one, so its bulk modulus, 41 GPa, is above the measured 25 GPa; for a check of the barostat against
the same model that does not matter. (The demo composite's Lennard-Jones with formal charges collapses to
a0 ≈ 4.65 Å, 18 % too small, so it is not used here.)

The reference bulk modulus comes from energies only: the crystal is scaled isotropically (ideal rock-salt sites,
no internal coordinates to relax) over +-3 % in volume, ``E(V)`` is fitted by a polynomial, and
``B(V) = V d²E/dV²``. Neither the stress nor any barostat enters it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from ase.build import bulk

from halopipe import Ewald, Group, LennardJones, Pipeline, System
from halopipe.distributed import DomainConfig
from halopipe.dynamics import Simulation

KCAL_PER_MOL = 0.0433641  # eV
R_MIN_TO_SIGMA = 2.0 ** (5.0 / 6.0)  # sigma = (R_min / 2) * 2^(5/6)
EPSILON = {11: 0.3526418 * KCAL_PER_MOL, 17: 0.0127850 * KCAL_PER_MOL}  # eV
SIGMA = {11: 1.212 * R_MIN_TO_SIGMA, 17: 2.711 * R_MIN_TO_SIGMA}  # Å, from R_min/2 = 1.212 and 2.711 Å
CUTOFF = 8.0  # Å, Lennard-Jones and Ewald real space
KB = 8.617333262e-5  # eV/K
EV_PER_A3_TO_GPA = 160.21766208


def nacl_pipeline() -> Pipeline:
    """Joung-Cheatham NaCl: Lennard-Jones (direct forces) and Ewald with formal charges."""
    return Pipeline(
        [
            Group([LennardJones(EPSILON, SIGMA, cutoff=CUTOFF)], autograd=False),
            Group([Ewald(cutoff=CUTOFF, accuracy=1e-6)], autograd=True),
        ],
        config=DomainConfig(skin=1.0),
    )


def nacl_crystal(volume: float, cells: int = 2) -> System:
    """The ideal rock-salt crystal of ``cells``³ conventional cells (8 ions each) with the given volume, Å³."""
    a = (volume / cells**3) ** (1.0 / 3.0)
    atoms = bulk("NaCl", "rocksalt", a=a, cubic=True).repeat((cells,) * 3)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


class StaticCurve:
    """The static ``E(V)`` of the ideal crystal, fitted by a sixth-degree polynomial over ``V0 (1 +- 3 %)``.

    Attributes
    ----------
    v0 : the volume of the minimum, Å³.
    residual : the largest fit residual, eV (a smooth curve gives ~1e-9 eV).
    """

    def __init__(self, pipeline: Pipeline, cells: int = 2, guess_a: float = 5.72, points: int = 25, degree: int = 6) -> None:
        self.cells = cells
        self.center = cells**3 * guess_a**3
        volumes = self.center * np.linspace(0.97, 1.03, points)
        energies = np.array([float(pipeline(nacl_crystal(v, cells))["energy"]) for v in volumes])
        self.coefficients = np.polyfit(volumes - self.center, energies, degree)
        self.residual = float(np.abs(energies - np.polyval(self.coefficients, volumes - self.center)).max())
        slope = np.polyder(self.coefficients, 1)
        roots = [r.real for r in np.roots(slope) if abs(r.imag) < 1e-9 and abs(r.real) < 0.03 * self.center]
        if len(roots) != 1:
            raise RuntimeError(f"StaticCurve: expected one minimum of E(V) within +-3 % of {self.center:.1f} Å³, found {roots}")
        self.v0 = self.center + roots[0]

    @property
    def lattice_constant(self) -> float:
        """The static lattice constant, Å."""
        return (self.v0 / self.cells**3) ** (1.0 / 3.0)

    def bulk_modulus(self, volume: float) -> float:
        """``V d²E/dV²`` of the static curve at ``volume``, eV/Å³."""
        return volume * float(np.polyval(np.polyder(self.coefficients, 2), volume - self.center))


def npt_volumes(simulation: Simulation, temperature: float, equilibration: int, steps: int) -> np.ndarray:
    """Volumes (Å³) after each of ``steps`` steps, following ``equilibration`` steps from velocities drawn at ``temperature``."""
    simulation.set_velocities(temperature, seed=1)
    simulation.run(equilibration)
    volumes = np.empty(steps)
    for k in range(steps):
        simulation.run(1)
        volumes[k] = float(torch.linalg.det(simulation.sharded.cell))
    return volumes


def compressibility_from_fluctuations(volumes: np.ndarray, temperature: float, blocks: int = 10) -> tuple[float, float]:
    """``kappa_T = <dV²> / (kB T <V>)`` (1/(eV/Å³)) and its standard error from ``blocks`` block averages.

    Each block's ``<dV²>`` is taken about the mean of the whole run, so the blocks' estimates average to the
    run's; blocks must be much longer than the volume's correlation time.
    """
    usable = volumes[: len(volumes) // blocks * blocks]
    mean = usable.mean()
    per_block = ((usable - mean) ** 2).reshape(blocks, -1).mean(axis=1) / (KB * temperature * mean)
    return float(per_block.mean()), float(per_block.std(ddof=1) / math.sqrt(blocks))
