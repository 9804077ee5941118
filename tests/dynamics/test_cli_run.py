"""``halopipe run`` / ``verify`` / ``demo`` end to end (2 spawned ranks), through the argparse entry points."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pytest
import torch
import yaml

from halopipe.config import parse_config
from halopipe.dynamics import load_checkpoint
from halopipe.dynamics.cli_commands import add_demo_parser, add_run_parser, add_verify_parser
from halopipe.dynamics.reporters import THERMO_COLUMNS

CONFIG = {
    "name": "tiny",
    "system": {"generator": {"type": "argon", "cells": 2, "rattle": 0.05}, "velocities": {"temperature": 300, "seed": 2}},
    "models": {"lj": {"type": "LennardJones", "epsilon": 0.0104, "sigma": 3.4, "cutoff": 6.0}},
    "domain": {"skin": 0.5},
    "integrator": {"type": "langevin", "timestep": 2.0, "temperature": 300, "friction": 0.02, "seed": 4},
    "steps": 30,
    "nproc": 2,
    "outputs": {"thermo_every": 10, "trajectory_every": 10, "checkpoint_every": 20, "progress": True},
}


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="halopipe")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_parser(sub), add_verify_parser(sub), add_demo_parser(sub)
    args = parser.parse_args(list(argv))
    return args.func(args)


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
    assert "continuing from step 30" in capfd.readouterr().out  # one rank: printed by this process
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


def test_config_errors_exit_2_naming_the_key(tmp_path, capfd):
    cfg = write_config(tmp_path / "bad.yaml", integrator={"type": "langevin", "timestep": 2.0})
    assert cli("run", str(cfg)) == 2
    assert "integrator.temperature" in capfd.readouterr().err
    assert cli("run", str(tmp_path / "missing.yaml")) == 2
    assert cli("run", str(write_config(tmp_path / "ok.yaml")), "--restart", "--output", str(tmp_path / "never")) == 2
    assert "no checkpoint.pt" in capfd.readouterr().err


def test_progress_bar_reports_rate_and_eta():
    import io

    from halopipe.dynamics import ProgressBar, Simulation, VelocityVerlet

    from ._workers import argon, lj

    stream = io.StringIO()
    Simulation(lj(), argon(cells=2), VelocityVerlet(2.0), reporters=[ProgressBar(stream=stream)]).run(20)
    lines = stream.getvalue().splitlines()
    assert lines[-2].startswith("step 20/20") and "100%" in lines[-2]
    assert all(word in lines[-2] for word in ("steps/s", "ns/day", "ETA"))
    assert len(lines) <= 13  # not a tty: about one line per 10 % of the run, plus the summary
