"""Constant pressure (MTK): against ASE, the conserved quantity, rank-count independence and restarts.

References: ASE's ``IsotropicMTKNPT`` with ASE's own Lennard-Jones calculator
(an integrator and forces no one here wrote); the single-process run for 2
and 4 ranks; the uninterrupted run for restarts. The start is a hot,
over-compressed argon crystal at a low target pressure, so the box expands by
about a third in 200 steps: the plan is rebuilt (strain and motion) and atoms
migrate between ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import units
from ase.md.nose_hoover_chain import IsotropicMTKNPT as AseIsotropicMTKNPT

from halopipe import Pipeline
from halopipe.distributed import DomainConfig
from halopipe.distributed.launch import spawn
from halopipe.dynamics import IsotropicMTKNPT, Simulation, load_checkpoint

from ._ase_npt import conserved_spread, to_ase
from ._npt_workers import PRESSURE, TEMPERATURE, npt, npt_run
from ._workers import argon, lj

STEPS, HALF = 200, 90


@pytest.fixture(scope="module")
def single():
    return npt_run(STEPS)


@pytest.mark.timeout(120)
def test_same_trajectory_as_ase_isotropic_mtk():
    dt, tdamp, pdamp = 2.0, 50.0, 200.0
    integrator = IsotropicMTKNPT(dt, TEMPERATURE, PRESSURE, tdamp=tdamp, pdamp=pdamp)
    integrator.momentum_conserved = False  # ASE counts Nf = 3N degrees of freedom; halopipe's default is 3N - 3
    sim = Simulation(Pipeline([lj()], config=DomainConfig(skin=0.4)), argon(cells=3), integrator)
    sim.set_velocities(TEMPERATURE, seed=3)
    atoms = to_ase(sim)
    ase_md = AseIsotropicMTKNPT(atoms, dt * units.fs, TEMPERATURE, PRESSURE * units.bar, tdamp * units.fs, pdamp * units.fs)
    volume0 = atoms.get_volume()
    sim.run(50)
    ase_md.run(50)
    mine = sim.system()
    assert atoms.get_volume() > 1.2 * volume0, "the cell should move a lot in the compared stretch"
    np.testing.assert_allclose(mine.cell.numpy(), atoms.cell.array, rtol=0, atol=1e-10)
    np.testing.assert_allclose(mine.positions.numpy(), atoms.positions, rtol=0, atol=1e-10)
    np.testing.assert_allclose(mine.fields["velocities"].numpy(), atoms.get_velocities() * units.fs, rtol=0, atol=1e-12)
    # Same extended energy: ASE's truncated (unshifted) LJ and halopipe's agree on the energy too.
    assert sim.thermo()["conserved"] == pytest.approx(ase_md.get_conserved_energy(), abs=1e-10)


@pytest.mark.timeout(120)
def test_conserved_quantity_error_is_second_order_in_the_timestep():
    # Over the same 400 fs of a strongly expanding box, the extended energy's excursion shrinks ~4x when dt halves.
    coarse, fine = (conserved_spread(argon(cells=3), npt(dt), TEMPERATURE, 400.0) for dt in (4.0, 2.0))
    assert coarse < 2e-3 * 108 * 0.0104, "drift below 0.2 % of epsilon per atom at dt = 4 fs"
    assert 2.5 < coarse / fine < 6.5, f"ratio {coarse / fine:.2f}"


@pytest.mark.timeout(60)
def test_cell_and_volume_follow_the_barostat(single):
    volume = float(np.linalg.det(single["cell"]))
    assert single["thermo"]["volume"] == pytest.approx(volume, rel=1e-12)
    assert volume > 1.25 * float(torch.linalg.det(argon(cells=3).cell))
    assert single["thermo"]["density"] == pytest.approx(108 * 39.948 * 1.66053906660 / volume, rel=1e-6)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_trajectory_independent_of_rank_count(single, world_size):
    multi = spawn(npt_run, world_size, STEPS, timeout=220)[0]
    assert multi["world"] == world_size
    assert multi["rebuilds"] > 5, "the strain and the motion should force several rebuilds"
    assert multi["owner_changes"] > 0, "atoms should migrate between ranks"
    diff = np.abs(multi["positions"] - single["positions"]).max()
    assert diff < 1e-8, f"{world_size} ranks: max |Δx| = {diff:.2e} Å"
    assert np.abs(multi["cell"] - single["cell"]).max() < 1e-8
    assert abs(multi["state"]["p_eps"] - single["state"]["p_eps"]) <= 1e-8 * abs(single["state"]["p_eps"])


@pytest.mark.timeout(300)
def test_restart_equals_uninterrupted_across_rank_counts(tmp_path, single):
    npt_run(HALF, str(tmp_path / "one_rank.pt"))
    state = load_checkpoint(tmp_path / "one_rank.pt")
    assert state["integrator"]["type"] == "IsotropicMTKNPT" and state["step"] == HALF
    assert state["integrator"]["state"]["eps"] != 0.0
    resumed_here = npt_run(STEPS, str(tmp_path / "again.pt"), str(tmp_path / "one_rank.pt"))
    on_two = spawn(npt_run, 2, STEPS, str(tmp_path / "two.pt"), str(tmp_path / "one_rank.pt"), timeout=280)[0]
    for got in (resumed_here, on_two):
        assert got["step"] == STEPS
        assert np.abs(got["positions"] - single["positions"]).max() < 1e-8
        assert np.abs(got["cell"] - single["cell"]).max() < 1e-8
        assert got["thermo"]["conserved"] == pytest.approx(single["thermo"]["conserved"], abs=1e-9)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"pdamp": -1.0}, "pdamp"),
        ({"pressure": float("nan")}, "pressure"),
        ({"pchain": 0}, "pchain"),
    ],
)
def test_bad_parameters_name_the_key(kwargs, key):
    args = {"timestep": 1.0, "temperature": 90.0, **kwargs}
    with pytest.raises(ValueError, match=key):
        IsotropicMTKNPT(**args)


@pytest.mark.timeout(60)
def test_needs_a_periodic_cell():
    from ..conftest import cluster

    sim = Simulation(lj(), cluster(charges=False), IsotropicMTKNPT(1.0, 90.0))
    with pytest.raises(ValueError, match="periodic along all three axes"):
        sim.run(1)


# ------------------------------------------- stochastic cell rescaling
@pytest.fixture(scope="module")
def single_csr():
    return npt_run(STEPS, kind="csr")


@pytest.mark.timeout(240)
def test_csr_trajectory_independent_of_rank_count_and_restart(tmp_path, single_csr):
    # The cell noise is one number per step keyed by (seed, step); the atoms' by (seed, step, id).
    assert float(np.linalg.det(single_csr["cell"])) > 1.25 * float(torch.linalg.det(argon(cells=3).cell))
    multi = spawn(npt_run, 2, STEPS, None, None, "csr", timeout=220)[0]
    assert multi["rebuilds"] > 5 and multi["owner_changes"] > 0
    assert np.abs(multi["positions"] - single_csr["positions"]).max() < 1e-8
    assert np.abs(multi["cell"] - single_csr["cell"]).max() < 1e-8
    npt_run(HALF, str(tmp_path / "csr.pt"), kind="csr")
    resumed = spawn(npt_run, 2, STEPS, str(tmp_path / "csr2.pt"), str(tmp_path / "csr.pt"), "csr", timeout=220)[0]
    assert np.abs(resumed["positions"] - single_csr["positions"]).max() < 1e-8
    assert np.abs(resumed["cell"] - single_csr["cell"]).max() < 1e-8


def test_yaml_builds_stochastic_cell_rescaling():
    from halopipe.config import parse_config
    from halopipe.dynamics import StochasticCellRescaling

    data = _yaml(taup=500.0, compressibility=2e-4)
    data["integrator"]["type"] = "npt_csr"
    built = parse_config(data).build_integrator()
    assert isinstance(built, StochasticCellRescaling)
    assert (built.pressure, built.taup, built.compressibility) == (1.0, 500.0, 2e-4)


# ------------------------------------------------------------------ YAML
def _yaml(**integrator) -> dict:
    return {
        "system": {"generator": {"type": "argon", "cells": 2}},
        "models": {"lj": {"type": "LennardJones", "epsilon": 0.0104, "sigma": 3.4, "cutoff": 6.0}},
        "integrator": {"type": "npt_mtk", "timestep": 2.0, "temperature": 90.0, "pressure": 1.0, **integrator},
        "steps": 10,
    }


def test_yaml_builds_the_mtk_barostat_with_pressure_in_bar():
    from halopipe.config import parse_config

    built = parse_config(_yaml(pdamp=300.0, pchain=2)).build_integrator()
    assert isinstance(built, IsotropicMTKNPT)
    assert (built.pressure, built.pdamp, built.pchain, built.tdamp) == (1.0, 300.0, 2, 200.0)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"pressure": "high"}, "integrator.pressure"),
        ({"pdamp": 0.0}, "integrator.pdamp"),
        ({"temperature": 0.0}, "integrator.temperature"),
        ({"tchain": 0}, "integrator.tchain"),
        ({"presure": 1.0}, "integrator.presure"),
    ],
)
def test_yaml_errors_name_the_key(change, key):
    from halopipe.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as info:
        parse_config(_yaml(**change), base=".")
    assert info.value.key == key, str(info.value)


def test_argon_npt_example_loads():
    from pathlib import Path

    from halopipe.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "argon_npt.yaml")
    assert isinstance(cfg.build_integrator(), IsotropicMTKNPT) and cfg.build_system().n_atoms == 500
