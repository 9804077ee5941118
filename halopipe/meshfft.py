"""Mesh transforms: the 3-D real FFT of a particle-mesh model, on one process or spread over ranks.

A particle-mesh model (PME) needs three things from the mesh, and a
:class:`MeshTransform` offers them without the model seeing ranks:

* :meth:`MeshTransform.boxes` takes the box of mesh points this process's
  atoms touch (any origin, wrapping periodically) and returns a
  :class:`BoxMap` for a box holding it (``lo``, ``extent``: the one the
  model spreads onto; a distributed transform pads and reuses it between
  steps), whose ``to_mesh`` adds box values into the mesh (each
  point's contributions summed at its owner) and whose ``from_mesh`` reads
  the mesh at the box points. Each is the other's adjoint, so both are
  differentiable.
* :meth:`MeshTransform.forward` / :meth:`MeshTransform.inverse`: the unscaled
  real-to-complex 3-D DFT of the part of the mesh this process holds, and its
  unscaled inverse, returning / taking the k-points this process owns.
* :meth:`MeshTransform.frequencies`: the signed integer frequencies of those
  owned k-points, so a kernel ``G(k)`` is evaluated only there.

Every operation takes leading batch dimensions (several meshes of the same
shape, the channels of one model): they travel together, in one message per
peer and one batched FFT, not one transform per mesh.

:class:`LocalMeshTransform` is the single-process implementation: the whole
mesh, ``torch.fft.rfftn``. The distributed transforms of
:mod:`halopipe.distributed.fft` implement the same interface with mesh slabs
or pencils per rank and all-to-all transposes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MeshTransform", "BoxMap", "LocalMeshTransform", "signed_frequencies", "box_flat_index"]


def signed_frequencies(n: int, device=None) -> torch.Tensor:
    """Integer frequencies ``0, 1, ..., -1`` of an ``n``-point DFT in FFT order."""
    m = torch.arange(n, device=device)
    return torch.where(m < (n + 1) // 2, m, m - n)  # torch.fft.fftfreq(n) * n: the Nyquist point of even n is -n/2


def box_flat_index(lo: tuple[int, int, int], extent: tuple[int, int, int], sizes) -> torch.Tensor:
    """Flat index into a ``sizes`` mesh of every point of a periodic box.

    The box starts at integer mesh index ``lo`` (any integer: it wraps) and
    spans ``extent`` points per axis (at most the mesh size). Returns a
    tensor of shape ``extent``.
    """
    n0, n1, n2 = (int(s) for s in sizes)
    g0 = (lo[0] + torch.arange(extent[0])) % n0
    g1 = (lo[1] + torch.arange(extent[1])) % n1
    g2 = (lo[2] + torch.arange(extent[2])) % n2
    return (g0[:, None, None] * n1 + g1[None, :, None]) * n2 + g2[None, None, :]


class BoxMap:
    """Adds a periodic box of mesh values into the mesh, and reads it back (adjoint pair).

    Attributes
    ----------
    lo, extent : the box (first mesh index per axis, any integer, wrapping; points per axis).
    """

    lo: tuple[int, int, int]
    extent: tuple[int, int, int]

    def to_mesh(self, box: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Sum the box's values ``(..., *extent)`` into this process's part of the mesh ``(..., *part)`` (differentiable)."""
        raise NotImplementedError

    def from_mesh(self, mesh: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """The mesh's values ``(..., *part)`` at the box points, shape ``(..., *extent)`` (differentiable)."""
        raise NotImplementedError


class MeshTransform:
    """Interface of a (possibly distributed) 3-D real FFT on a periodic mesh of ``sizes``.

    Attributes
    ----------
    sizes : mesh points per axis.
    parts : number of processes sharing the mesh (1 for the local transform).
    """

    sizes: tuple[int, int, int]
    parts: int = 1

    def boxes(self, lo: tuple[int, int, int], extent: tuple[int, int, int]) -> BoxMap:  # pragma: no cover - interface
        """A map between a box holding ``(lo, extent)`` and the mesh (collective when distributed)."""
        raise NotImplementedError

    def forward(self, mesh: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Unscaled real-to-complex DFT over the last three axes; returns the owned k-points."""
        raise NotImplementedError

    def inverse(self, spectrum: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Unscaled complex-to-real inverse DFT of the owned k-points; returns this process's mesh part."""
        raise NotImplementedError

    def frequencies(self, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover - interface
        """Signed integer frequencies of the owned k-points, broadcastable to the spectrum's shape."""
        raise NotImplementedError


class _LocalBoxMap(BoxMap):
    def __init__(self, lo, extent, sizes) -> None:
        self.sizes = tuple(int(s) for s in sizes)
        self.lo = tuple(int(v) for v in lo)
        self.extent = tuple(int(e) for e in extent)
        self.flat = box_flat_index(lo, extent, sizes)

    def to_mesh(self, box: torch.Tensor) -> torch.Tensor:
        batch = box.shape[:-3]
        flat = self.flat.to(box.device).reshape(-1)
        mesh = box.new_zeros(batch + (math.prod(self.sizes),))
        return mesh.index_add(-1, flat, box.reshape(batch + (-1,))).reshape(batch + self.sizes)

    def from_mesh(self, mesh: torch.Tensor) -> torch.Tensor:
        batch = mesh.shape[:-3]
        return mesh.reshape(batch + (-1,))[..., self.flat.to(mesh.device).reshape(-1)].reshape(batch + self.extent)


class LocalMeshTransform(MeshTransform):
    """The whole mesh in one process: ``torch.fft.rfftn`` and ``irfftn``."""

    def __init__(self, sizes) -> None:
        self.sizes = tuple(int(s) for s in sizes)

    def boxes(self, lo, extent) -> BoxMap:
        return _LocalBoxMap(lo, extent, self.sizes)

    def forward(self, mesh: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfftn(mesh, dim=(-3, -2, -1), norm="backward")

    def inverse(self, spectrum: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfftn(spectrum, s=self.sizes, dim=(-3, -2, -1), norm="forward")

    def frequencies(self, device=None):
        n0, n1, n2 = self.sizes
        m0 = signed_frequencies(n0, device)[:, None, None]
        m1 = signed_frequencies(n1, device)[None, :, None]
        m2 = torch.arange(n2 // 2 + 1, device=device)[None, None, :]
        return m0, m1, m2
