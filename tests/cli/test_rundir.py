"""Run-directory locks: a live run's directory is refused, a dead run's lock is taken over."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import pytest

from halopipe.cli.rundir import LOCK, RunDirectoryBusy, RunLock, claim_run_directory

from ._helpers import halopipe, write_config

HOLD = """
import sys, time
from halopipe.cli.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


@contextmanager
def _held(directory):
    """A live process holding the lock of ``directory``; killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def holder(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    with _held(directory) as proc:
        yield directory, proc


def test_a_live_holder_is_refused_and_a_dead_one_taken_over(holder):
    directory, proc = holder
    with pytest.raises(RunDirectoryBusy, match=f"pid {proc.pid}"):
        RunLock(directory).acquire()
    proc.kill()
    proc.wait()  # reaped: the pid no longer exists
    with RunLock(directory).acquire() as lock:
        assert lock.holder()[0] != proc.pid and (directory / LOCK).is_file()
    assert not (directory / LOCK).exists()  # released


def test_a_fresh_run_skips_an_empty_directory_another_run_holds(holder):
    directory, _ = holder
    with claim_run_directory(directory, restart=False) as claimed:
        assert claimed == directory.with_name("run.1")


@pytest.mark.timeout(90)
def test_restart_refuses_a_run_directory_held_by_a_live_run(tmp_path):
    cfg, base = write_config(tmp_path / "tiny.yaml"), tmp_path / "base"
    assert halopipe("run", str(cfg), "--output", str(base), cwd=tmp_path, timeout=60).returncode == 0
    with _held(base) as proc:
        done = halopipe("run", str(cfg), "--output", str(base), "--restart", "--steps", "8", cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"halopipe run: error: run directory {base} is in use by a live run (pid {proc.pid}")
    )
