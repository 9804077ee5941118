"""``halopipe run`` / ``verify`` / ``demo`` end to end (2 spawned ranks at most), through :func:`halopipe.cli.main`."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch
import yaml

from halopipe.cli import main
from halopipe.config import load_config, parse_config
from halopipe.dynamics import load_checkpoint
from halopipe.dynamics.reporters import THERMO_COLUMNS

from ._helpers import ROOT, TINY, halopipe
from ._helpers import write_config as write_tiny

CONFIG = {
    **TINY,
    "steps": 30,
    "nproc": 2,
    "outputs": {"thermo_every": 10, "trajectory_every": 10, "checkpoint_every": 20, "progress": True},
}
"""``TINY`` run long enough for checkpoints, trajectory frames and the progress bar, on 2 ranks."""


def cli(*argv: str) -> int:
    return main(list(argv))


def write_config(path: Path, **changes) -> Path:
    data = {**CONFIG, **changes}
    path.write_text(yaml.safe_dump(data))
    return path


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.timeout(180)
def test_run_writes_outputs_and_restart_continues_exactly(tmp_path, capfd):
    import ase.io

    cfg = write_config(tmp_path / "tiny.yaml")
    out = tmp_path / "out"
    assert cli("run", str(cfg), "--output", str(out)) == 0
    printed = capfd.readouterr().out
    assert f"run directory: {out}" in printed and "2 rank(s)" in printed
    for name in ("thermo.csv", "thermo.png", "trajectory.xyz", "checkpoint.pt", "config.yaml"):
        assert (out / name).is_file(), name
    log = rows(out / "thermo.csv")
    assert tuple(log[0]) == THERMO_COLUMNS and [int(r["step"]) for r in log] == [0, 10, 20, 30]
    assert all(float(r["pressure_GPa"]) == float(r["pressure_GPa"]) for r in log)  # evaluated (not NaN) at logged steps
    frames = ase.io.read(out / "trajectory.xyz", index=":")
    initial = parse_config(CONFIG).build_system()
    assert [f.info["step"] for f in frames] == [0, 10, 20, 30]
    assert (frames[0].numbers == initial.numbers.numpy()).all()
    assert abs(frames[0].positions - initial.positions.numpy()).max() < 1e-7  # original atom order (extxyz keeps 8 decimals)
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 30

    # Continue to 50 steps, on one rank; the log must equal that of an uninterrupted 50-step run.
    assert cli("run", str(cfg), "--output", str(out), "--restart", "--steps", "50", "--nproc", "1") == 0
    assert "continuing from step 30" in capfd.readouterr().err  # a setup note
    straight = tmp_path / "straight"
    assert cli("run", str(cfg), "--output", str(straight), "--steps", "50", "--nproc", "1") == 0
    resumed, reference = rows(out / "thermo.csv"), rows(straight / "thermo.csv")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == [str(s) for s in range(0, 51, 10)]
    for a, b in zip(resumed, reference):
        for column in THERMO_COLUMNS[2:]:
            assert float(a[column]) == pytest.approx(float(b[column]), rel=1e-9, abs=1e-9), column
    assert len(ase.io.read(out / "trajectory.xyz", index=":")) == 6
    a, b = load_checkpoint(out / "checkpoint.pt"), load_checkpoint(straight / "checkpoint.pt")
    assert torch.allclose(a["positions"], b["positions"], rtol=0, atol=1e-9)


@pytest.mark.timeout(60)
def test_run_numbers_fresh_directories_and_restart_picks_the_latest(tmp_path, capfd):
    cfg = write_config(tmp_path / "tiny.yaml", steps=4, nproc=1, outputs={"thermo_every": 2, "trajectory_every": 0, "progress": False})
    base = tmp_path / "runs"
    assert cli("run", str(cfg), "--output", str(base)) == 0
    assert cli("run", str(cfg), "--output", str(base)) == 0
    assert (base / "checkpoint.pt").is_file() and (tmp_path / "runs.1" / "checkpoint.pt").is_file()
    capfd.readouterr()
    assert cli("run", str(cfg), "--output", str(base), "--restart", "--steps", "6") == 0
    assert f"run directory: {tmp_path / 'runs.1'}" in capfd.readouterr().out
    assert load_checkpoint(tmp_path / "runs.1" / "checkpoint.pt")["step"] == 6


@pytest.mark.timeout(90)
def test_verify_reports_agreement(tmp_path, capfd):
    data = {
        **CONFIG,
        "system": {"generator": {"type": "nacl", "cells": 2}},
        "models": {
            "lj": {"type": "LennardJones", "epsilon": {"Na": 0.0115, "Cl": 0.0043}, "sigma": {"Na": 2.0, "Cl": 3.4}, "cutoff": 6.0},
            "q": {"type": "ChargeModel", "cutoff": 4.0},
            "c": {"type": "DSFCoulomb", "cutoff": 7.0},
        },
        "groups": [{"steps": ["lj"], "autograd": False}, {"steps": ["q", "c"]}],
    }
    cfg = tmp_path / "v.yaml"
    cfg.write_text(yaml.safe_dump(data))
    assert cli("verify", str(cfg), "--nproc", "2") == 0
    text = capfd.readouterr().out
    assert "2 rank(s)" in text and "max |ΔF|" in text and "OK" in text


@pytest.mark.timeout(90)
def test_demo_is_a_short_md_run(tmp_path, capfd):
    assert cli("demo", "--atoms", "64", "--steps", "20", "--output", str(tmp_path / "demo")) == 0
    text = capfd.readouterr().out
    assert "2 rank(s)" in text and f"run directory: {tmp_path / 'demo'}" in text
    assert "thermo.png" in text and "thermo.csv" in text
    assert (tmp_path / "demo" / "thermo.png").stat().st_size > 1000


def test_demo_and_the_demo_example_use_different_run_directories(tmp_path, monkeypatch):
    from halopipe.cli.demo import DEMO_CONFIG

    monkeypatch.chdir(tmp_path)
    example = load_config(ROOT / "examples" / "demo.yaml", check_system=False).outputs["directory"]
    builtin = parse_config(DEMO_CONFIG, check_system=False).outputs["directory"]
    assert Path(example).parent == Path(builtin).parent == tmp_path / "runs" and example != builtin


def test_config_errors_exit_2_naming_the_key(tmp_path, capfd):
    cfg = write_config(tmp_path / "bad.yaml", integrator={"type": "langevin", "timestep": 2.0})
    assert cli("run", str(cfg)) == 2
    assert "integrator.temperature" in capfd.readouterr().err
    assert cli("run", str(tmp_path / "missing.yaml")) == 2
    assert cli("run", str(write_config(tmp_path / "ok.yaml")), "--restart", "--output", str(tmp_path / "never")) == 2
    assert "no checkpoint.pt" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_restart_of_a_finished_run_says_nothing_to_do(tmp_path, capfd):
    cfg = write_tiny(tmp_path / "tiny.yaml")
    assert cli("run", str(cfg), "--output", str(tmp_path / "out")) == 0
    capfd.readouterr()
    assert cli("run", str(cfg), "--output", str(tmp_path / "out"), "--restart") == 0
    out = capfd.readouterr().out
    assert "nothing to do; raise --steps" in out and "nan" not in out
    assert load_checkpoint(tmp_path / "out" / "checkpoint.pt")["step"] == 6  # untouched


@pytest.mark.timeout(60)
def test_progress_rate_agrees_with_the_summary(tmp_path, capfd):
    cfg = write_tiny(tmp_path / "tiny.yaml", steps=40, outputs={"progress": True, "plot": False, "trajectory_every": 0})
    assert cli("run", str(cfg), "--output", str(tmp_path / "out")) == 0
    captured = capfd.readouterr()
    bar = re.findall(r"step 40/40 100%.*?([0-9.]+) steps/s", captured.err)
    summary = re.findall(r"40 steps in [0-9.]+ s, ([0-9.]+) steps/s", captured.out)
    assert bar and summary and bar[-1] == summary[0]


@pytest.mark.timeout(60)
def test_run_shows_setup_progress_before_the_first_step(tmp_path):
    cfg = write_tiny(tmp_path / "tiny.yaml", outputs={"progress": True, "plot": False, "trajectory_every": 0})
    done = halopipe("run", str(cfg), "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    first_bar = next(k for k, line in enumerate(lines) if line.startswith("step "))  # splitlines also splits tqdm's \r
    notes = [line for line in lines[:first_bar] if re.match(r"\[\s*[0-9.]+ s\] ", line)]
    assert [n.split("] ", 1)[1].split()[0] for n in notes][:3] == ["reading", "building", "scattering"]
    assert float(notes[0][1:].split()[0]) < 5.0  # generous: the first line is printed before torch is imported


def test_nproc_above_the_core_count_warns(capsys):
    import os

    from halopipe.cli.run import check_cores

    cores = len(os.sched_getaffinity(0))
    check_cores("halopipe run", cores)
    assert capsys.readouterr().err == ""
    check_cores("halopipe run", cores + 1)
    assert f"--nproc {cores + 1} exceeds the {cores} CPU core(s)" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_restart_with_changed_physics_is_refused_unless_allowed_and_logged(tmp_path, capfd):
    out = tmp_path / "out"
    assert cli("run", str(write_tiny(tmp_path / "tiny.yaml")), "--output", str(out)) == 0
    bigger = write_tiny(tmp_path / "bigger.yaml", system={"generator": {"type": "argon", "cells": 3, "rattle": 0.05}})
    stronger = write_tiny(tmp_path / "stronger.yaml", models={"lj": {"type": "LennardJones", "epsilon": 0.02, "sigma": 3.4, "cutoff": 6.0}})
    capfd.readouterr()
    assert cli("run", str(bigger), "--output", str(out), "--restart", "--steps", "8") == 2
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"halopipe run: error: {out / 'checkpoint.pt'} was written with other physics: ")
    assert "system.n_atoms: 32 -> 108" in err and "system.cell: " in err
    assert "--allow-changed" in err
    assert cli("run", str(stronger), "--output", str(out), "--restart", "--steps", "8") == 2
    assert "models.lj.epsilon: tensor values changed" in capfd.readouterr().err
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 6  # neither refused restart ran
    assert cli("run", str(stronger), "--output", str(out), "--restart", "--allow-changed", "--steps", "8") == 0
    assert "models.lj.epsilon: tensor values changed" in (out / "changes.log").read_text()
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 8
    assert cli("run", str(stronger), "--output", str(out), "--restart", "--steps", "10") == 0  # the new physics is now the checkpoint's


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut short", b"\x80\x04garbage", b"not a checkpoint at all\n"])
def test_restart_from_an_unreadable_checkpoint_gives_one_line_naming_it(tmp_path, capfd, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(content)
    assert cli("run", str(write_tiny(tmp_path / "tiny.yaml")), "--output", str(out), "--restart") == 2
    errors = [line for line in capfd.readouterr().err.splitlines() if not line.startswith("[")]
    assert len(errors) == 1 and errors[0].startswith(f"halopipe run: error: checkpoint {out / 'checkpoint.pt'} ")
    assert "pickl" not in errors[0].lower() and "weights_only" not in errors[0]


@pytest.mark.timeout(150)
def test_run_under_torchrun_and_a_busy_directory_there(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from halopipe.cli.rundir import LOCK

    cfg, out = write_tiny(tmp_path / "tiny.yaml"), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def torchrun(*args):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "halopipe.cli"]
        return subprocess.run([*command, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=70)

    done = torchrun("run", str(cfg), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert "tiny: 32 atoms on 2 rank(s)" in done.stdout and load_checkpoint(out / "checkpoint.pt")["step"] == 6
    (out / LOCK).write_text(f"{os.getpid()} {socket.gethostname()}\n")  # this live test process holds it
    done = torchrun("run", str(cfg), "--output", str(out), "--restart", "--steps", "8")
    assert done.returncode != 0 and f"run directory {out} is in use by a live run (pid {os.getpid()}" in done.stderr
