"""Which kernel technology runs: Warp when it loads, eager torch otherwise."""

from __future__ import annotations

import functools
import logging
import os
import warnings

__all__ = ["kernel_backend", "warp_module"]


@functools.cache
def warp_module():
    """The initialised ``warp`` module, or None when Warp is unavailable or disabled."""
    if os.environ.get("HALOPIPE_KERNELS", "").lower() == "torch":
        return None
    try:
        import warp as wp

        # Warp's start-up banner, module-load lines and its "no CUDA driver" note are noise in a CPU run of N ranks.
        wp.config.log_level = logging.ERROR
        wp.init()
    except Exception as exc:  # any failure to load means the torch fallback, never a crash
        warnings.warn(f"halopipe: NVIDIA Warp unavailable ({exc}); pair kernels run in eager torch", stacklevel=2)
        return None
    return wp


def kernel_backend() -> str:
    """``"warp"`` or ``"torch"``: the technology pair kernels use in this process."""
    return "warp" if warp_module() is not None else "torch"
