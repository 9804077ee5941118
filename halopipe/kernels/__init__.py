"""Compiled pair kernels behind the :class:`~halopipe.models.Model` contract.

Hot loops over pairs run as NVIDIA Warp kernels: one source compiled for the
CPU (LLVM, cached on disk after the first build, a few seconds) and for CUDA.
Each kernel has an eager-torch twin of the same arithmetic, used when Warp is
not installed or cannot compile, for float32, or when ``HALOPIPE_KERNELS=torch``
is set; both give the same numbers to rounding. A kernel returns energies,
forces (and ``dE/dq`` where charges are an input) in one pass over a half
list; :class:`torch.autograd.Function` wrappers turn these into an analytic
backward, so kernel models also work in autograd groups and wired chains.
PME's B-spline charge spreading and mesh interpolation (:mod:`.mesh`) follow
the same pattern, with one thread per atom.
"""

from __future__ import annotations

from .backend import kernel_backend
from .ewald import real_space_energies_autograd, real_space_terms
from .lennard_jones import LJTables, lj_energies_autograd, lj_energy_forces
from .mesh import SplineBox, interpolate_mesh, mesh_coordinates, spread_charges, support_start
from .pairs import HalfList

__all__ = [
    "kernel_backend",
    "HalfList",
    "LJTables",
    "lj_energy_forces",
    "lj_energies_autograd",
    "real_space_terms",
    "real_space_energies_autograd",
    "SplineBox",
    "mesh_coordinates",
    "support_start",
    "spread_charges",
    "interpolate_mesh",
]
