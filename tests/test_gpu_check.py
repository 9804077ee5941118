"""benchmarks/gpu_check.sh, the GPU check of a lent machine, keeps working on a CPU (issue 22).

Its ``--dry-run`` runs every step in a minimal CPU form: the CUDA tests collected, the two-rank comparison
on the CPU against one process, one step of the LJ benchmark. A rotten path, flag or import fails here.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")


def run_check(*args: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), HALOPIPE_GPU_PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_dry_run_passes_every_step(tmp_path):
    result = run_check("--dry-run", out=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "summary.md").read_text()
    for step in ("CUDA tests (collected)", "2 ranks, gloo (cpu)", "md_throughput LJ (cpu, 1 step)"):
        assert f"| {step} | ok |" in summary, summary
    assert "two ranks on cpu vs one CPU process" in summary
    assert "lj-argon-32k" in summary
    assert (tmp_path / "gpu_check.log").stat().st_size > 0


def test_unknown_argument_is_refused(tmp_path):
    result = run_check("--bogus", out=tmp_path)
    assert result.returncode == 2
    assert "usage" in result.stderr
