"""Compiled pair kernels behind the :class:`~halopipe.models.Model` contract.

Hot loops over pairs run as NVIDIA Warp kernels: one source compiled for the
CPU (LLVM, cached on disk after the first build, about 2 s) and for CUDA.
Each kernel comes with an eager-torch twin of the same arithmetic, used when
Warp is not installed or cannot compile, or when ``HALOPIPE_KERNELS=torch``
is set; both give the same numbers to rounding. Kernels return energies and
forces in one pass; :class:`torch.autograd.Function` wrappers turn the forces
into an analytic backward, so kernel models also work in autograd groups.
"""

from __future__ import annotations

from .backend import kernel_backend
from .lennard_jones import HalfList, lj_energies_autograd, lj_energy_forces

__all__ = ["kernel_backend", "HalfList", "lj_energy_forces", "lj_energies_autograd"]
