"""Run directories and their locks.

A fresh run takes the first unused directory among ``base``, ``base.1``,
``base.2`` ...; ``--restart`` takes the latest of them that holds a
checkpoint. Either way the directory is claimed with a lock file holding the
launcher's pid and host, created atomically (``O_EXCL``), so two live runs
never write into one directory. A lock whose process is gone (the launcher was
killed) is stale and is taken over.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["CHECKPOINT", "LOCK", "RunDirectoryBusy", "RunLock", "claim_run_directory"]

CHECKPOINT = "checkpoint.pt"
LOCK = ".halopipe.lock"


class RunDirectoryBusy(RuntimeError):
    """Another live run holds the run directory."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class RunLock:
    """The lock file of a run directory; a context manager that releases it.

    Parameters
    ----------
    directory : the run directory (must exist).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK
        self.token = f"{os.getpid()} {socket.gethostname()}\n"
        self.held = False

    def holder(self) -> tuple[int, str] | None:
        """``(pid, host)`` written in the lock file, ``None`` if unreadable."""
        try:
            pid, host = self.path.read_text().split()
            return int(pid), host
        except (OSError, ValueError):
            return None

    def _stale(self) -> bool:
        holder = self.holder()
        if holder is None:
            return True  # a half-written or foreign file: no run can be shown to hold it
        pid, host = holder
        return host == socket.gethostname() and not _alive(pid)

    def try_acquire(self) -> bool:
        """Create the lock, taking over a stale one; ``False`` if a live run holds it."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._stale():
                    return False
                self.path.unlink(missing_ok=True)  # the holder is dead: take over
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(self.token)
            self.held = True
            return True
        return False

    def acquire(self) -> RunLock:
        """Create the lock or raise :class:`RunDirectoryBusy` naming the live holder."""
        if not self.try_acquire():
            pid, host = self.holder() or (0, "?")
            raise RunDirectoryBusy(
                f"run directory {self.directory} is in use by a live run (pid {pid} on {host}); "
                f"wait for it to finish or stop it, then retry (its lock is {self.path})"
            )
        return self

    def release(self) -> None:
        if self.held:
            try:
                if self.path.read_text() == self.token:
                    self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _candidates(base: Path) -> Iterator[Path]:
    yield base
    k = 1
    while True:
        yield base.with_name(f"{base.name}.{k}")
        k += 1


def _latest_with_checkpoint(base: Path) -> Path:
    found = None
    for path in _candidates(base):
        if not path.exists():
            break
        if (path / CHECKPOINT).is_file():
            found = path
    if found is None:
        raise FileNotFoundError(f"--restart: no {CHECKPOINT} in {base} (or {base.name}.N); run once without --restart first")
    return found


def _fresh(base: Path) -> RunLock:
    for path in _candidates(base):
        if path.exists() and not (path.is_dir() and not any(path.iterdir())):
            continue
        path.mkdir(parents=True, exist_ok=True)
        lock = RunLock(path)
        if lock.try_acquire():  # another run may have claimed this empty directory a moment ago
            return lock
    raise AssertionError("unreachable")


@contextmanager
def claim_run_directory(base: str | Path, restart: bool) -> Iterator[Path]:
    """Claim a run directory (locked until the ``with`` block ends) and yield it.

    A fresh run gets the first unused of ``base``, ``base.1`` ...; a restart
    the latest with a checkpoint, or :class:`RunDirectoryBusy` if a live run
    holds it.
    """
    base = Path(base)
    lock = RunLock(_latest_with_checkpoint(base)).acquire() if restart else _fresh(base)
    with lock:
        yield lock.directory
