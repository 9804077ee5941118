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
from halopipe.dynamics import Langevin, Simulation, VelocityVerlet, load_checkpoint
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


# ------------------------------------------------------------ unreadable files
def _empty(path):
    path.write_bytes(b"")


def _truncated(path):
    checkpoint_run("nve", 2, str(path), None)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt(path):
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


def _foreign(path):
    torch.save(torch.nn.Linear(2, 2), path)  # a pickled module: torch.load(weights_only=True) refuses it with pickling advice


def _other_dict(path):
    torch.save({"step": 3, "positions": torch.zeros(2, 3)}, path)


@pytest.mark.parametrize("make", [_empty, _truncated, _corrupt, _foreign, _other_dict], ids=lambda f: f.__name__[1:])
def test_an_unreadable_checkpoint_gives_one_message_naming_the_file(tmp_path, make):
    from halopipe.dynamics import CheckpointError

    path = tmp_path / "checkpoint.pt"
    make(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path} ") and "\n" not in message
    assert "weights_only" not in message and "pickl" not in message.lower()


# ------------------------------------------------------ changed physics
def _stopped_run(tmp_path):
    checkpoint_run("langevin", 4, str(tmp_path / "c.pt"), None)
    return tmp_path / "c.pt"


def test_restart_refuses_a_changed_model_parameter_naming_it(tmp_path):
    from halopipe import LennardJones
    from halopipe.dynamics import CheckpointMismatch

    path = _stopped_run(tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"models\.LennardJones\.epsilon: tensor values changed"):
        Simulation.restart(path, LennardJones(epsilon=0.02, sigma=3.4, cutoff=6.0), integrator("langevin"))
    with pytest.raises(CheckpointMismatch, match=r"models\.LennardJones\.cutoff: 6\.0 -> 6\.5"):
        Simulation.restart(path, LennardJones(epsilon=0.0104, sigma=3.4, cutoff=6.5), integrator("langevin"))
    with pytest.raises(CheckpointMismatch, match=r"integrator\.temperature: 400\.0 -> 300\.0"):
        Simulation.restart(path, lj(), Langevin(2.0, temperature=300.0, friction=0.02, seed=11))
    sim = Simulation.restart(path, LennardJones(epsilon=0.02, sigma=3.4, cutoff=6.0), integrator("langevin"), allow_changed=True)
    assert sim.changes == ["models.LennardJones.epsilon: tensor values changed"] and sim.step == 4


def test_restart_refuses_a_changed_system_naming_the_atom_count(tmp_path):
    from halopipe.dynamics import CheckpointMismatch

    path = _stopped_run(tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"system\.n_atoms: 256 -> 108.*system\.species\.Ar: 256 -> 108"):
        Simulation.restart(path, lj(), integrator("langevin"), system=argon(cells=3))
    Simulation.restart(path, lj(), integrator("langevin"), system=argon(cells=4, rattle=0.3))  # other positions: the same system


def test_checkpoint_fingerprint_names_the_physics(tmp_path):
    physics = load_checkpoint(_stopped_run(tmp_path))["physics"]
    assert physics["system"]["n_atoms"] == 256 and physics["system"]["species"] == {"Ar": 256}
    assert physics["system"]["pbc"] == [True, True, True]
    np.testing.assert_allclose(physics["system"]["cell"], np.diag([4 * 5.26] * 3), rtol=0, atol=1e-12)  # 4 fcc cells of 5.26 Å
    assert physics["models"]["LennardJones"]["cutoff"] == 6.0 and physics["models"]["LennardJones"]["type"] == "LennardJones"
    assert physics["groups"] == [{"steps": ["LennardJones"], "autograd": False, "wire": [{}], "bind": [{}]}]
    assert physics["integrator"] == {"type": "Langevin", "timestep": 2.0, "temperature": 400.0, "friction": 0.02, "seed": 11}


# -------------------------------------------------------------- step in errors
def test_a_model_error_names_the_md_step():
    from tests.cli._helpers import FailingLJ

    model = FailingLJ(fail_call=4, message="non-finite energy from FailingLJ", epsilon=0.0104, sigma=3.4, cutoff=6.0)
    sim = Simulation(model, argon(cells=2), VelocityVerlet(2.0))
    with pytest.raises(ValueError, match=r"^MD step 3: non-finite energy from FailingLJ$"):
        sim.run(10)
    assert sim.step == 2
