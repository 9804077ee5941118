"""The launcher never leaves ranks behind: killed by SIGTERM or SIGKILL, its ranks (and forkserver) end within seconds.

A helper launcher (``python -m tests.distributed._lifetime_workers DIR``) spawns two ranks that sleep and record
their pids; the test signals the launcher and then watches every recorded pid.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._lifetime_workers import alive, forkserver_pids, rank_pids

ROOT = Path(__file__).resolve().parents[2]


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_ranks_end_with_their_launcher(tmp_path, sig):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-m", "tests.distributed._lifetime_workers", str(tmp_path)], cwd=ROOT, env=env)
    try:
        assert _wait_for(lambda: len(rank_pids(tmp_path)) == 2, 60), "the ranks did not start"
        pids = rank_pids(tmp_path) + forkserver_pids(tmp_path)
        assert all(alive(pid) for pid in pids)
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        assert _wait_for(lambda: not any(alive(pid) for pid in pids), 10), [pid for pid in pids if alive(pid)]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in rank_pids(tmp_path) + forkserver_pids(tmp_path):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
