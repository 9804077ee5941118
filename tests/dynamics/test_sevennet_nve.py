"""NVE energy conservation of SevenNet-0 + DFT-D3 (default cutoffs) on bilayer graphene + Li, float64.

A short velocity-Verlet run (1 fs steps from 300 K) of the example's structure, 102 atoms, on one process. The
total energy must stay flat: a force that is not the exact gradient of the energy (a missing ghost-feature
gradient between SevenNet's layers, D3's coordination-number chain term) drifts by 1e-2 eV/atom/ps or more.
The longer float32/float64 drift measurement is ``python benchmarks/mlip_halo.py --model 7net-0 --drift-steps N``
(docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sevenn")

from halopipe import DFTD3, Group, Pipeline, SevenNet, Step, System
from halopipe.dynamics import Reporter, Simulation, VelocityVerlet

pytestmark = [pytest.mark.sevenn, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 40
EXCURSION_BOUND = 1e-4  # eV / atom over the run; measured: see the module docstring of the assertion below


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
    system = System.from_ase(bilayer_li(n_in_plane=5, n_li=2))
    pipeline = Pipeline([Group([Step(SevenNet("7net-0", dtype="float64")), Step(DFTD3("pbe"))])], skin=1.0)
    energies = Energies()
    sim = Simulation(pipeline, system, VelocityVerlet(1.0), reporters=[energies])
    sim.set_velocities(300.0, seed=1)
    sim.run(STEPS)
    e = np.array(energies.e)
    excursion = np.abs(e - e[0]).max() / system.n_atoms
    print(f"\n{STEPS} NVE steps: largest |E - E0| {excursion:.2e} eV/atom")  # shown with -s
    assert excursion < EXCURSION_BOUND, f"total energy moved by {excursion:.2e} eV/atom in {STEPS} fs"
