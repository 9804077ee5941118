"""Which kernel technology runs: Warp when it loads, eager torch otherwise."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import sys
import tempfile
import warnings

__all__ = ["kernel_backend", "warp_module"]

# Warp's native init writes this line with fprintf(stderr) whenever it cannot dlopen the driver; no config flag
# or environment variable turns it off (warp 1.19, native/cuda_util.cpp: init_cuda_driver).
_NO_DRIVER_NOTE = "Could not find or load the NVIDIA CUDA driver"


@functools.cache
def warp_module():
    """The initialised ``warp`` module, or None when Warp is unavailable or disabled."""
    if os.environ.get("HALOPIPE_KERNELS", "").lower() == "torch":
        return None
    try:
        import warp as wp

        # Warp's start-up banner and module-load lines are noise in a CPU run of N ranks.
        wp.config.log_level = logging.ERROR
        if _cuda_driver_loadable():
            wp.init()
        else:
            _init_without_driver_note(wp)
    except Exception as exc:  # any failure to load means the torch fallback, never a crash
        warnings.warn(f"halopipe: NVIDIA Warp unavailable ({exc}); pair kernels run in eager torch", stacklevel=2)
        return None
    return wp


def kernel_backend() -> str:
    """``"warp"`` or ``"torch"``: the technology pair kernels use in this process."""
    return "warp" if warp_module() is not None else "torch"


def _cuda_driver_loadable() -> bool:
    """Whether the loader finds the CUDA driver under the names Warp's native init tries, in its order."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so", "libcuda.so.1")
    for name in names:
        with contextlib.suppress(OSError):
            ctypes.CDLL(name)
            return True
    return False


def _init_without_driver_note(wp) -> None:
    """``wp.init()`` with the C-level stderr captured; every line but the no-driver note is written back."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            wp.init()
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sink.seek(0)
            captured = sink.read().decode(errors="replace")
            # Written back even when init fails: its other messages explain the failure.
            sys.stderr.write("".join(line for line in captured.splitlines(keepends=True) if _NO_DRIVER_NOTE not in line))
