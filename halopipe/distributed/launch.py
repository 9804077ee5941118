"""Starting ranks: local process spawning, or the environment of a launcher.

:func:`spawn` runs ``fn(*args)`` on ``nproc`` fresh local processes joined in a
gloo (CPU) or NCCL (one GPU per rank) process group and returns each rank's
return value. It never leaves processes behind:

* the first error a rank reports (or a rank dying without a report, or the
  timeout) ends the job: the other ranks get a short grace to report, then are
  terminated, and :class:`SpawnError` carries the failing rank, a one-line
  message and the traceback;
* SIGTERM, SIGINT or SIGHUP to the launcher end its ranks before it exits;
* if the launcher is killed outright, each rank notices within moments: a
  watchdog thread in the rank sees its end of a pipe to the launcher reach
  EOF, and ``PR_SET_PDEATHSIG`` (Linux) kills it with the forkserver, its OS
  parent, which exits with the launcher.

C++ warnings of the rendezvous store ("Broken pipe" with a stack trace, one
per store call after a rank died) are silenced in the ranks unless
``TORCH_CPP_LOG_LEVEL`` is set. :func:`launched_by_runner` tells whether we run
under ``torchrun`` (or ``srun``), in which case :func:`init_from_environment`
joins that group (and asks to die with the runner's agent).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..allocator import keep_freed_memory
from .affinity import bind_local_rank
from .comm import DistributedError

__all__ = ["spawn", "launched_by_runner", "init_from_environment", "SpawnError"]

GRACE_SECONDS = 3.0  # after the first error, how long the other ranks may take to report before they are stopped
_PR_SET_PDEATHSIG = 1


class SpawnError(RuntimeError):
    """A spawned rank failed, died, or the ranks did not finish in time.

    Attributes
    ----------
    rank : the rank where the error arose (``None`` for a timeout of several ranks).
    message : one line for people, naming the rank and the cause.
    details : the failing rank's traceback (for ``--debug`` output).
    failures : every rank's one-line report received before the ranks were stopped, by rank.
    """

    def __init__(self, message: str, rank: int | None = None, details: str = "", failures: dict[int, str] | None = None) -> None:
        super().__init__(f"{message}\n\n{details}".rstrip())
        self.rank, self.message, self.details = rank, message, details
        self.failures = dict(failures or {})


def launched_by_runner() -> bool:
    """True under torchrun (RANK/WORLD_SIZE set) or srun with several tasks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def init_from_environment(backend: str | None = None, timeout: float = 300.0) -> None:
    """Join the process group described by torchrun's or srun's environment."""
    keep_freed_memory()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is our parent: do not outlive it
        _die_with_parent(signal.SIGTERM)
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:  # torchrun; srun binds its tasks itself
        bind_local_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), torch.get_num_threads(), only_if_unbound=True)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))


def spawn(fn, nproc: int, *args, timeout: float = 300.0, backend: str = "gloo", threads: int = 1) -> list:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return the list of results by rank.

    ``fn`` must be importable (a module-level function). Raises
    :class:`SpawnError` as soon as a rank fails (after a short grace for the
    others to report) or when the ranks do not all finish within ``timeout``
    seconds (``math.inf``: no limit); every rank has ended when it returns or raises.
    """
    if nproc < 1:
        raise ValueError(f"spawn: nproc must be >= 1, got {nproc}")
    if not timeout > 0:
        raise ValueError(f"spawn: timeout must be positive seconds (math.inf for none), got {timeout}")
    # Read by libtorch when the forkserver imports it, so it must be in the environment before the first start.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    lifeline, lifeline_end = ctx.Pipe(duplex=False)  # ranks hold the reading end; EOF means the launcher is gone
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, backend, threads, fn, args, results, lifeline), daemon=True) for r in range(nproc)
    ]
    reports: dict[int, tuple[bool, object]] = {}
    try:
        with _signals_end_children():
            for p in procs:
                p.start()
            lifeline.close()
            reports = _collect(procs, results, timeout)
    finally:
        succeeded = len(reports) == nproc and all(ok for ok, _ in reports.values())
        _end(procs, patience=5.0 if succeeded else 1.0)  # ranks that succeeded are shutting down their groups
        lifeline_end.close()
    return _outcome(reports, nproc, timeout)


# ------------------------------------------------------------------ the launcher side
def _collect(procs, results, timeout: float) -> dict[int, tuple[bool, object]]:
    """Reports by rank, until all ranks reported, or the grace after the first failure ended, or the timeout."""
    reports: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
    grace_end = math.inf
    while len(reports) < len(procs) and time.monotonic() < min(deadline, grace_end):
        try:
            rank, ok, value = _unpacked(results.get(timeout=0.1))
            reports[rank] = (ok, value)
        except queue.Empty:
            _note_silent_deaths(procs, results, reports)
        if grace_end == math.inf and any(not ok for ok, _ in reports.values()):
            grace_end = time.monotonic() + GRACE_SECONDS
    return reports


def _unpacked(report: tuple) -> tuple:
    """A rank's report with its return value unpickled (see :func:`_packed`)."""
    rank, ok, value = report
    return rank, ok, pickle.loads(value) if ok else value


def _note_silent_deaths(procs, results, reports: dict) -> None:
    """Record ranks that exited without reporting (killed, out of memory, a crash in C++)."""
    for r, p in enumerate(procs):
        if r in reports or p.exitcode is None:
            continue
        with contextlib.suppress(queue.Empty):  # its report may have arrived just before it exited
            while True:
                rank, ok, value = _unpacked(results.get_nowait())
                reports[rank] = (ok, value)
        if r not in reports:
            why = f"was killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
            hint = " (is its return value picklable?)" if p.exitcode == 0 else ""
            reports[r] = (False, {"origin": r, "message": f"rank {r} {why} without reporting a result{hint}", "traceback": ""})


def _outcome(reports: dict[int, tuple[bool, object]], nproc: int, timeout: float) -> list:
    failures = {r: v for r, (ok, v) in reports.items() if not ok}
    silent = sorted(set(range(nproc)) - set(reports))
    if failures:
        first = next(iter(failures.values()))
        # Prefer the failing rank's own report (it has the real traceback) over a peer's copy of it.
        chosen = next((v for r, v in failures.items() if r == v["origin"]), first)
        message = chosen["message"] + (f" (rank(s) {silent} had not finished and were stopped)" if silent else "")
        raise SpawnError(message, chosen["origin"], chosen["traceback"], {r: v["message"] for r, v in failures.items()})
    if silent:
        only = silent[0] if len(silent) == 1 else None
        raise SpawnError(f"spawn: rank(s) {silent} did not finish within {timeout:g} s and were stopped", only)
    return [reports[r][1] for r in range(nproc)]


def _end(procs, patience: float) -> None:
    """Give ranks ``patience`` seconds to exit by themselves, then terminate, then kill."""
    deadline = time.monotonic() + patience
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.pid is not None and p.is_alive()]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
        for p in alive:
            p.join(timeout=2.0)


@contextlib.contextmanager
def _signals_end_children():
    """While ranks run, turn SIGTERM/SIGHUP into SystemExit (and SIGINT into KeyboardInterrupt) so ``finally`` ends them."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        yield
        return

    def leave(signum, frame):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    wanted = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {s: signal.signal(s, leave) for s in wanted}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ the rank side
def _worker(rank: int, nproc: int, port: int, backend: str, threads: int, fn, args, results, lifeline) -> None:
    _exit_with_launcher(lifeline)
    keep_freed_memory()
    if backend != "nccl":  # CPU ranks: each its own cores (a GPU rank's host thread is left to the scheduler)
        bind_local_rank(rank, nproc, threads)
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=300)
        )
        value = fn(*args)
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        results.put((rank, False, _failure_report(rank, exc)))
        # Leave at once: the group may hold operations abandoned for a failed peer, which a clean shutdown would wait for.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    try:
        packed = _packed(value)
    except Exception as exc:
        results.put((rank, False, _failure_report(rank, exc)))
    else:
        results.put((rank, True, packed))
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _packed(value) -> bytes:
    """The return value pickled by value.

    torch's multiprocessing queue would pass tensors as shared-memory file
    descriptors, which the launcher can only open while the rank still runs;
    a rank that returns and exits first leaves a ConnectionResetError. Plain
    pickle copies the data, so a report outlives its rank.
    """
    return pickle.dumps(value)


def _failure_report(rank: int, exc: BaseException) -> dict:
    origin = exc.rank if isinstance(exc, DistributedError) and exc.rank is not None else rank
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    message = text if isinstance(exc, DistributedError) else f"rank {rank}: {type(exc).__name__}: {text}".rstrip(": ")
    return {"origin": origin, "message": message, "traceback": traceback.format_exc()}


def _exit_with_launcher(lifeline) -> None:
    """End this rank when the launcher dies, however it dies."""
    _die_with_parent(signal.SIGKILL)  # the OS parent is the forkserver, which exits with the launcher

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            lifeline.recv_bytes()  # the launcher never writes: this returns only at EOF
        os._exit(1)

    threading.Thread(target=watch, name="halopipe-launcher-watchdog", daemon=True).start()


def _die_with_parent(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)
