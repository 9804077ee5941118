"""Reporters: the progress bar follows the stepping loop; the thermo plot shows the conserved-energy drift and pressure."""

from __future__ import annotations

import io
import re

import numpy as np

from halopipe.dynamics import ProgressBar, Simulation, ThermoLog, VelocityVerlet
from halopipe.dynamics.reporters import read_thermo, thermo_figure

from ._workers import argon, lj


def test_progress_bar_counts_the_loop_and_shows_its_rate(tmp_path):
    stream = io.StringIO()
    sim = Simulation(lj(), argon(cells=2), VelocityVerlet(2.0), reporters=[ProgressBar(stream=stream, interval=0)])
    sim.set_velocities(300.0, seed=1)
    sim.run(20)
    frames = [f for f in re.split(r"[\r\n]+", stream.getvalue()) if f.strip()]
    assert frames[0].startswith("step 1/20") and frames[-1].startswith("step 20/20 100%")
    rate = float(re.search(r"([0-9.]+) steps/s", frames[-1]).group(1))
    assert rate == float(f"{sim.timing.steps / sim.timing.seconds:.1f}") and sim.timing.steps == 20
    ns_day = float(re.search(r"([0-9.]+) ns/day", frames[-1]).group(1))
    assert abs(ns_day - rate * 2.0 * 86400 / 1e6) <= 1e-3 * max(1.0, ns_day)  # 2 fs per step
    sim.run(5)  # a second run gets a bar of its own
    assert re.split(r"[\r\n]+", stream.getvalue().strip())[-1].startswith("step 5/5 100%")


def test_thermo_figure_has_drift_temperature_and_pressure_axes(tmp_path):
    sim = Simulation(lj(), argon(cells=2), VelocityVerlet(2.0), reporters=[ThermoLog(tmp_path / "t.csv", every=2)])
    sim.set_velocities(300.0, seed=1)
    sim.run(20)
    data = read_thermo(tmp_path / "t.csv")
    fig = thermo_figure(data, n_atoms=32)
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["E - E(0)  [eV]", "conserved drift\n[meV/atom]", "temperature [K]", "pressure [GPa]", "density [g/cm³]"]
    drift = fig.axes[1].lines[0].get_ydata()
    conserved = np.asarray(data["conserved_eV"])
    np.testing.assert_allclose(drift, (conserved - conserved[0]) * 1000 / 32, rtol=0, atol=1e-12)
    np.testing.assert_allclose(fig.axes[3].lines[0].get_ydata(), data["pressure_GPa"], rtol=0, atol=0)
    assert np.isfinite(data["pressure_GPa"]).all()
    # 32 argon atoms in a 10.52 Å cube: an independent density in g/cm³
    np.testing.assert_allclose(data["density_g_cm3"], 32 * 39.948 * 1.66053906660 / 10.52**3, rtol=1e-6)
    np.testing.assert_allclose(fig.axes[4].lines[0].get_ydata(), data["density_g_cm3"], rtol=0, atol=0)
