"""Checkpoints and restarts: a restarted run equals the uninterrupted one, on 1 and 2 ranks and across rank counts.

The reference is the uninterrupted run itself. Neighbour lists are rebuilt
from scratch after a restart, so forces may differ in the last bit (pairs are
summed in another order); the comparison allows 1e-9 Å.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from halopipe.distributed.launch import spawn
from halopipe.dynamics import Simulation, load_checkpoint
from halopipe.dynamics.simulation import atomic_save

from ._workers import argon, checkpoint_run, checkpoint_suite, integrator, lj

TOTAL, HALF = 60, 25
TOL = 1e-9


def _close(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert (a["positions"] - b["positions"]).abs().max() < TOL
    assert (a["velocities"] - b["velocities"]).abs().max() < TOL


def _same_state(a: dict, b: dict) -> None:
    """Integrator states agree key by key (values are numbers or lists of numbers)."""
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(np.asarray(a[key], dtype=float), np.asarray(b[key], dtype=float), rtol=1e-9, atol=1e-12, err_msg=key)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["langevin", "nhc", "fire", "nve"])
def test_restart_equals_uninterrupted_single_process(tmp_path, kind):
    full = checkpoint_run(kind, TOTAL, None, None)
    checkpoint_run(kind, HALF, str(tmp_path / "c.pt"), None, every=10)
    state = load_checkpoint(tmp_path / "c.pt")
    assert state["step"] == HALF  # written at the end (and at 10, 20 before)
    resumed = checkpoint_run(kind, TOTAL, str(tmp_path / "c.pt"), str(tmp_path / "c.pt"))
    _close(resumed, full)
    _same_state(resumed["state"], full["state"])  # thermostat / FIRE state continues too


@pytest.mark.timeout(150)
def test_restart_on_two_ranks_and_across_rank_counts(tmp_path):
    kind = "langevin"
    full_1 = checkpoint_run(kind, TOTAL, None, None)
    checkpoint_run(kind, HALF, str(tmp_path / "one_rank.pt"), None)
    two = spawn(checkpoint_suite, 2, str(tmp_path), TOTAL, HALF, kind, timeout=140)[0]
    _close(two["full"], full_1)  # 2 ranks uninterrupted == 1 rank uninterrupted
    _close(two["resumed_from_1"], full_1)  # stopped on 1 rank, continued on 2
    from_2 = checkpoint_run(kind, TOTAL, str(tmp_path / "again.pt"), str(tmp_path / "n_ranks.pt"))
    _close(from_2, full_1)  # stopped on 2 ranks, continued on 1
    on_2 = load_checkpoint(tmp_path / "n_ranks.pt")
    on_1 = load_checkpoint(tmp_path / "one_rank.pt")
    assert torch.allclose(on_2["positions"], on_1["positions"], rtol=0, atol=TOL)  # full arrays, original order


def test_checkpoint_contents(tmp_path):
    system = argon(cells=2)
    sim = Simulation(lj(), system, integrator("nhc"), checkpoint=tmp_path / "c.pt", checkpoint_every=5)
    sim.set_velocities(300.0, seed=2)
    sim.run(12)
    state = load_checkpoint(tmp_path / "c.pt")
    assert state["step"] == 12 and state["time"] == pytest.approx(24.0)
    assert torch.equal(state["numbers"], system.numbers) and torch.equal(state["masses"], system.masses)
    assert state["integrator"]["type"] == "NoseHooverChain" and len(state["integrator"]["state"]["eta"]) == 3
    assert torch.allclose(state["positions"], sim.system().positions)
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    atomic_save({"format": "x", "value": 1}, path)

    def crash(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"format": "x", "value": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["value"] == 1  # the old checkpoint survives intact
    assert os.listdir(tmp_path) == ["c.pt"]


def test_restart_rejects_other_integrator_and_missing_file(tmp_path):
    checkpoint_run("nve", 3, str(tmp_path / "c.pt"), None)
    with pytest.raises(ValueError, match="VelocityVerlet"):
        Simulation.restart(tmp_path / "c.pt", lj(), integrator("langevin"))
    with pytest.raises(FileNotFoundError):
        Simulation.restart(tmp_path / "missing.pt", lj(), integrator("nve"))
