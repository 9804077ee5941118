"""Helpers of the command-line tests: the ``halopipe`` command in a subprocess, a tiny configuration, a failing model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
import yaml

from halopipe import LennardJones

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "name": "tiny",
    "system": {"generator": {"type": "argon", "cells": 2, "rattle": 0.05}, "velocities": {"temperature": 300, "seed": 2}},
    "models": {"lj": {"type": "LennardJones", "epsilon": 0.0104, "sigma": 3.4, "cutoff": 6.0}},
    "domain": {"skin": 0.5},
    "integrator": {"type": "langevin", "timestep": 2.0, "temperature": 300, "friction": 0.02, "seed": 4},
    "steps": 6,
    "nproc": 1,
    "outputs": {"thermo_every": 2, "trajectory_every": 0, "checkpoint_every": 0, "progress": False, "plot": False},
}


def write_config(path: Path, **changes) -> Path:
    """``TINY`` with top-level ``changes``, written as YAML."""
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def halopipe(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``halopipe ARGS`` (this checkout's code) in a fresh process; stdout and stderr captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "halopipe.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class FailingLJ(LennardJones):
    """Lennard-Jones that raises on one rank from its ``fail_call``-th evaluation on (a stand-in for a model's failure)."""

    def __init__(self, fail_rank: int = 0, fail_call: int = 1, message: str = "deliberate failure", **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_rank, self.fail_call, self.message = fail_rank, fail_call, message
        self._calls = 0

    def forward(self, view, direct: bool = False):
        self._calls += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == self.fail_rank and self._calls >= self.fail_call:
            raise ValueError(self.message)
        return super().forward(view, direct)
