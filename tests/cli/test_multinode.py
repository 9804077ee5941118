"""Two launchers, as on two nodes: ``torchrun --nnodes 2 --nproc-per-node 2`` with one rendezvous endpoint.

Both launchers run on this machine (node ranks 0 and 1) and join through a
c10d rendezvous; ``halopipe run`` and ``halopipe verify`` then run on 4 ranks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from halopipe.dynamics import load_checkpoint

from ._helpers import ROOT
from ._helpers import write_config as write_tiny


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_nodes(cwd: Path, *args: str, timeout: float = 150) -> list[subprocess.CompletedProcess]:
    """Start two launchers (node ranks 0 and 1) with the same endpoint; wait for both."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{_free_port()}"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "halopipe-test"]
    procs = [
        subprocess.Popen(
            [*launcher, "--node-rank", str(node), "-m", "halopipe.cli", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.timeout(400)
def test_run_and_verify_with_two_launchers(tmp_path):
    cfg, out = write_tiny(tmp_path / "tiny.yaml"), tmp_path / "out"
    nodes = two_nodes(tmp_path, "run", str(cfg), "--output", str(out))
    assert all(n.returncode == 0 for n in nodes), [n.stderr[-2000:] for n in nodes]
    assert "tiny: 32 atoms on 4 rank(s)" in nodes[0].stdout + nodes[1].stdout
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 6
    nodes = two_nodes(tmp_path, "verify", str(cfg))
    assert all(n.returncode == 0 for n in nodes), [n.stderr[-2000:] for n in nodes]
