"""Two launchers, as on two nodes: ``torchrun --nnodes 2 --nproc-per-node 2`` with one rendezvous endpoint.

Both launchers run on this machine (node ranks 0 and 1) and join through a
c10d rendezvous; ``halopipe run`` and ``halopipe verify`` then run on 4 ranks.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from halopipe.dynamics import load_checkpoint

from ._helpers import ROOT
from ._helpers import write_config as write_tiny


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_launchers(cwd: Path, *args: str, rdzv_id: str = "halopipe-test") -> list[subprocess.Popen]:
    """Two launchers (node ranks 0 and 1, two ranks each) with the same rendezvous endpoint, running ``halopipe ARGS``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{_free_port()}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    procs = []
    for node in (0, 1):
        # Output goes to files: an undrained pipe of one launcher would block it and, through the rendezvous, the other.
        logs = dict(stdout=open(cwd / f"node{node}.out", "w"), stderr=open(cwd / f"node{node}.err", "w"))
        # A session of its own: a launcher that must be killed takes its workers with it (no orphans).
        command = [*launcher, "--node-rank", str(node), "-m", "halopipe.cli", *args]
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True, **logs))
        procs[-1].logs = (cwd / f"node{node}.out", cwd / f"node{node}.err")
        time.sleep(3.0 if node == 0 else 0.0)  # node 0 binds the endpoint first and hosts the store, as the first node would
    return procs


def outputs(p: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) a launcher started by :func:`start_launchers` wrote."""
    return p.logs[0].read_text(), p.logs[1].read_text()


def two_nodes(cwd: Path, *args: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``halopipe ARGS`` under two launchers; wait for both."""
    procs = start_launchers(cwd, *args)
    done = []
    try:
        for p in procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logs = [f"node {k}: {out[-3000:]}\n{err[-3000:]}" for k, (out, err) in enumerate(map(outputs, procs))]
                pytest.fail(f"the launchers did not finish in {timeout} s:\n" + "\n".join(logs))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, *outputs(p)))
    finally:
        kill_all(procs)
    return done


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill every launcher still running, with its workers (its whole session)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.timeout(600)
def test_run_with_two_launchers(tmp_path):
    cfg, out = write_tiny(tmp_path / "tiny.yaml"), tmp_path / "out"
    nodes = two_nodes(tmp_path, "run", str(cfg), "--output", str(out))
    assert all(n.returncode == 0 for n in nodes), [n.stderr[-2000:] for n in nodes]
    assert "tiny: 32 atoms on 4 rank(s)" in nodes[0].stdout + nodes[1].stdout
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 6


@pytest.mark.timeout(600)
def test_verify_with_two_launchers(tmp_path):
    cfg = write_tiny(tmp_path / "tiny.yaml")
    nodes = two_nodes(tmp_path, "verify", str(cfg))
    assert all(n.returncode == 0 for n in nodes), [n.stderr[-2000:] for n in nodes]


@pytest.mark.timeout(300)
def test_a_rank_killed_on_node_1_ends_every_rank_with_a_message(tmp_path):
    """SIGKILL one worker of launcher 1 mid-run: both launchers end, non-zero, and node 0 names the failure."""
    cfg, out = write_tiny(tmp_path / "tiny.yaml", steps=1_000_000), tmp_path / "out"
    procs = start_launchers(tmp_path, "run", str(cfg), "--output", str(out), rdzv_id="halopipe-kill")
    try:
        deadline = time.monotonic() + 150
        while not (out / "thermo.csv").exists():  # the run is stepping
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.5)
        workers = subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True).stdout.split()
        assert workers, "launcher 1 has no worker processes"
        os.kill(int(workers[0]), signal.SIGKILL)
        killed_at = time.monotonic()
        for p in procs:
            p.wait(timeout=120)
        results = [outputs(p) for p in procs]
        elapsed = time.monotonic() - killed_at
    finally:
        kill_all(procs)
    assert all(p.returncode != 0 for p in procs)
    assert elapsed < 120  # generous hang bound, not a timing claim
    node0_err = results[0][1]
    assert re.search(r"halopipe run: error on rank \d: .*rank", node0_err), node0_err[-3000:]  # one line naming the rank
