"""NVE energy conservation of SevenNet-0 + DFT-D3 (default cutoffs) on bilayer graphene + Li, float64.

A short velocity-Verlet run (ten 1 fs steps from 300 K) of the example's structure cut to 37 atoms, on one
process. The total energy must stay within the integrator's own fluctuation: a force that is not the exact
gradient of the energy (a missing ghost-feature gradient between SevenNet's layers, D3's coordination-number
chain term) moves it by an order of magnitude more.
The longer float32/float64 drift measurement is ``python benchmarks/mlip_halo.py --model 7net-0 --drift-steps N``
(docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sevenn")

from halopipe import DFTD3, DomainConfig, Group, Pipeline, SevenNet, Step, System
from halopipe.dynamics import Reporter, Simulation, VelocityVerlet

pytestmark = [pytest.mark.sevenn, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 10
# Measured (float64, 2-core CPU): largest |E - E0| 3.5e-4 eV/atom over the 10 fs, the ordinary velocity-Verlet
# fluctuation for graphene's ~21 fs C-C stretch at dt = 1 fs ((omega dt)^2 / 8 of the vibrational energy).
# A force that misses a ghost-feature gradient (errors ~0.1 eV/Å at 0.02 Å/fs) moves E by ~2e-2 eV/atom in 10 fs.
EXCURSION_BOUND = 1.5e-3  # eV / atom


def bilayer_li(n_in_plane: int, n_li: int):
    path = Path(__file__).resolve().parents[2] / "examples" / "data" / "make_bilayer_li.py"
    spec = importlib.util.spec_from_file_location("make_bilayer_li", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.bilayer_li(n_in_plane=n_in_plane, n_li=n_li)


class Energies(Reporter):
    needs_thermo = True

    def __init__(self) -> None:
        super().__init__(1)
        self.e: list[float] = []

    def report(self, sim, thermo) -> None:
        self.e.append(thermo["total"])


@pytest.mark.timeout(600)
def test_nve_total_energy_is_conserved():
    system = System.from_ase(bilayer_li(n_in_plane=3, n_li=1))
    pipeline = Pipeline([Group([Step(SevenNet("7net-0", dtype="float64")), Step(DFTD3("pbe"))])], config=DomainConfig(skin=1.0))
    energies = Energies()
    sim = Simulation(pipeline, system, VelocityVerlet(1.0), reporters=[energies])
    sim.set_velocities(300.0, seed=1)
    sim.run(STEPS)
    e = np.array(energies.e)
    excursion = np.abs(e - e[0]).max() / system.n_atoms
    print(f"\n{STEPS} NVE steps: largest |E - E0| {excursion:.2e} eV/atom")  # shown with -s
    assert excursion < EXCURSION_BOUND, f"total energy moved by {excursion:.2e} eV/atom in {STEPS} fs"
