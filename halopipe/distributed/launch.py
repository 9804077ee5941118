"""Starting ranks: local process spawning, or the environment of a launcher.

:func:`spawn` runs ``fn(*args)`` on ``nproc`` fresh local processes joined in a
gloo (CPU) or NCCL (one GPU per rank) process group, returns each rank's
return value, and never leaves processes behind: on an error or a timeout all
ranks are killed and the first error is raised with the failing rank's
traceback. :func:`launched_by_runner` tells whether we run under ``torchrun``
(or ``srun``), in which case :func:`init_from_environment` joins that group.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "launched_by_runner", "init_from_environment", "SpawnError"]


class SpawnError(RuntimeError):
    """A spawned rank failed or the ranks did not finish in time."""


def launched_by_runner() -> bool:
    """True under torchrun (RANK/WORLD_SIZE set) or srun with several tasks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def init_from_environment(backend: str | None = None, timeout: float = 300.0) -> None:
    """Join the process group described by torchrun's or srun's environment."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, nproc: int, port: int, backend: str, threads: int, fn, args, results) -> None:
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=300)
        )
        value = fn(*args)
        results.put((rank, True, value))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn, nproc: int, *args, timeout: float = 300.0, backend: str = "gloo", threads: int = 1) -> list:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return the list of results by rank.

    ``fn`` must be importable (a module-level function). Raises
    :class:`SpawnError` with the failing rank's traceback if any rank raises,
    and kills every rank if they do not all finish within ``timeout`` seconds.
    """
    if nproc < 1:
        raise ValueError(f"spawn: nproc must be >= 1, got {nproc}")
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, backend, threads, fn, args, results), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    collected: dict[int, tuple[bool, object]] = {}
    try:
        while len(collected) < nproc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SpawnError(f"spawn: ranks {sorted(set(range(nproc)) - set(collected))} did not finish within {timeout} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
                collected[rank] = (ok, value)
            except queue.Empty:  # nothing reported this second: has a rank died without reporting?
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    raise SpawnError(f"spawn: rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: v for r, (ok, v) in collected.items() if not ok}
    if failures:
        raise SpawnError("\n".join(f"rank {r} failed: {v}" for r, v in sorted(failures.items())))
    return [collected[r][1] for r in range(nproc)]
