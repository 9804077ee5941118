"""Rank functions for the failure, launcher and resource tests (importable by spawned ranks).

Each rank records its pid (and its OS parent's, the forkserver) in a directory, so a test can check that
no process outlives the job; failing ranks record the wall-clock time of the raise.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from halopipe import Group, LennardJones, Model, ModelOutput, Pipeline, Step
from halopipe.distributed import DistributedError, DistributedPipeline, DomainConfig, ShardedSystem
from halopipe.distributed.launch import spawn

from ._workers import LJ, make_pipeline, make_system


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def record_pids(directory: str) -> None:
    Path(directory, f"pid-{rank()}").write_text(f"{os.getpid()} {os.getppid()}")


def rank_pids(directory: str) -> list[int]:
    """The pids the ranks recorded so far."""
    return sorted(int(f.read_text().split()[0]) for f in Path(directory).glob("pid-*"))


def forkserver_pids(directory: str) -> list[int]:
    """The ranks' OS parents (the forkserver), as recorded."""
    return sorted({int(f.read_text().split()[1]) for f in Path(directory).glob("pid-*")})


def alive(pid: int) -> bool:
    """Is ``pid`` a running process (a zombie waiting for a parent that does not reap counts as ended)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Misbehave(Model):
    """Raises (or stalls) on the chosen ranks after the others started communicating in the same evaluation."""

    cutoff = 3.0

    def __init__(self, how: str, ranks: list[int], directory: str):
        super().__init__()
        self.how, self.ranks, self.directory = how, ranks, directory

    def forward(self, view, direct=False):
        if rank() in self.ranks:
            Path(self.directory, f"raise-{rank()}").write_text(repr(time.time()))
            if self.how == "stall":
                time.sleep(3600)
            raise ValueError("model exploded on purpose")
        q = view.refresh(view.positions[: view.n_owned, 0])
        return ModelOutput(energies=q[: view.n_owned] * 0.0 + view.global_sum(q.sum()) * 0.0)


def misbehave(how: str, ranks: list[int], directory: str, timeout: float | None = None) -> None:
    """Evaluate a pipeline whose last model raises or stalls on ``ranks``; the default configuration unless ``timeout``."""
    record_pids(directory)
    config = DomainConfig() if timeout is None else DomainConfig(timeout=timeout)
    sharded = ShardedSystem.scatter(make_system("triclinic") if rank() == 0 else None, config)
    pipeline = Pipeline([Group([Step(LennardJones(**LJ, cutoff=4.0))]), Misbehave(how, ranks, directory)])
    DistributedPipeline(pipeline, config)(sharded)


def sleep_forever(directory: str) -> None:
    record_pids(directory)
    time.sleep(3600)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def many_scatters(count: int) -> dict:
    """Scatter a small system ``count`` times; descriptors and threads after the first and after the last."""
    system = make_system("small_box") if rank() == 0 else None
    config = DomainConfig(timeout=60)
    ShardedSystem.scatter(system, config)
    before = (open_descriptors(), len(os.listdir("/proc/self/task")))
    for _ in range(count - 1):
        ShardedSystem.scatter(system, config)
    return {"fds": (before[0], open_descriptors()), "threads": (before[1], len(os.listdir("/proc/self/task")))}


def evaluate_after_a_failure() -> dict | None:
    """A guarded failure on rank 1 (caught), then a fresh scatter and evaluation: exact vs one process (rank 0)."""
    config = DomainConfig(timeout=60)
    system = make_system("triclinic")
    first = ShardedSystem.scatter(system if rank() == 0 else None, config)
    try:
        with first.comm.guard("a step that fails on rank 1"):
            if rank() == 1:
                raise ValueError("failed on purpose")
            first.all_reduce(torch.ones(1))
        message = "no error"
    except DistributedError as exc:
        message = str(exc)
    try:
        first.all_reduce(torch.ones(1))
        spent = "reused"
    except DistributedError as exc:
        spent = str(exc)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    pipeline = make_pipeline("all")
    with DistributedPipeline(pipeline, config) as dp:
        out = dp(sharded, stress=True)
    forces = sharded.gather(out["forces"])
    if rank() != 0:
        return None
    ref = pipeline(system, stress=True)
    return {
        "message": message,
        "spent": spent,
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "force": float((forces - ref["forces"]).abs().max()),
    }


def main() -> None:
    """``python -m tests.distributed._lifetime_workers DIR``: a launcher whose two ranks run until killed."""
    from tests.distributed._lifetime_workers import sleep_forever as importable  # not __main__.sleep_forever

    spawn(importable, 2, sys.argv[1], timeout=math.inf)


if __name__ == "__main__":
    main()
