"""What the command line tells people while it works and when it fails.

``note`` writes a time-stamped setup line to stderr (rank 0 only), so a run
shows signs of life from its first second, before the progress bar exists.
``failure_message`` turns any exception, including a failure on a spawned
rank, into one line naming the rank; the traceback is for ``--debug``.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["note", "set_clock", "clock", "failure_message", "warn"]

_clock = {"t0": time.time()}


def set_clock(t0: float) -> None:
    """Count note times from ``t0`` (``time.time()`` of the launcher), also on spawned ranks."""
    _clock["t0"] = float(t0)


def clock() -> float:
    return _clock["t0"]


def _rank() -> int:
    """This process's rank: from the process group once it exists, else from torchrun's environment, else 0."""
    if "torch" in sys.modules:  # never import torch just to ask
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def note(message: str) -> None:
    """A setup line on stderr (rank 0), stamped with seconds since the command started."""
    if _rank() != 0:
        return
    print(f"[{time.time() - _clock['t0']:6.1f} s] {message}", file=sys.stderr, flush=True)


def warn(prog: str, message: str) -> None:
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


def _rank_failure(exc: BaseException) -> tuple[int | None, str]:
    """The failing rank and its one-line message, from a :class:`~halopipe.distributed.launch.SpawnError`."""
    rank = getattr(exc, "rank", None)
    message = getattr(exc, "message", None)
    if message is None:  # the launcher's text: "rank R failed: Type: message\n<traceback>"
        text = str(exc)
        head = text.split("\nTraceback (most recent call last):", 1)[0].strip()
        if head.startswith("rank ") and " failed: " in head:
            first, message = head.split(" failed: ", 1)
            rank = int(first.split()[1]) if first.split()[1].isdigit() else rank
        else:
            message = head
    return rank, message


def failure_message(prog: str, exc: BaseException) -> str:
    """One line: ``prog: error [on rank R]: message``."""
    launch = sys.modules.get("halopipe.distributed.launch")  # loaded if ranks were spawned
    if launch is not None and isinstance(exc, launch.SpawnError):
        rank, message = _rank_failure(exc)
    else:
        rank = _rank() if "WORLD_SIZE" in os.environ else None  # under torchrun every rank reports
        message = str(exc) if isinstance(exc, (ValueError, OSError, RuntimeError)) else f"{type(exc).__name__}: {exc}"
    where = f" on rank {rank}" if rank is not None else ""
    return f"{prog}: error{where}: {message}"
