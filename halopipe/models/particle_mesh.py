"""What the particle-mesh models share: mesh sizes, the B-spline influence function, the atoms' support box.

:class:`~halopipe.models.pme.PME` and :class:`~halopipe.models.dftd3_mesh.DFTD3Mesh`
spread per-atom values onto a regular mesh with SPME's cardinal B-splines
(:mod:`halopipe.kernels.mesh`), filter the mesh by FFT (:mod:`halopipe.meshfft`)
and interpolate back. Both pick the mesh the same way (:func:`mesh_size`:
FFT-friendly sizes from a spacing), undo the B-splines' smoothing the same way
(:func:`influence`, ``1 / |b(m)|^2``), and spread onto the periodic box their
atoms' supports cover (:class:`Stencil`), which a distributed transform widens
to the box it caches.
"""

from __future__ import annotations

import math

import torch

from ..kernels.mesh import SplineBox, check_inside, gather_values, mesh_coordinates, spread_values, support_start

__all__ = [
    "MAX_MESH_POINTS",
    "smooth_size",
    "mesh_size",
    "bspline_influence",
    "influence",
    "half_spectrum_multiplicity",
    "same_tensor",
    "Stencil",
    "CotangentCheck",
]

MAX_MESH_POINTS = 1 << 26  # 0.5 GiB per float64 mesh: beyond it, ask for a coarser setting


def smooth_size(n: int) -> int:
    """Smallest integer >= n whose only prime factors are 2, 3 and 5 (fast FFTs)."""
    while True:
        m = n
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        if m == 1:
            return n
        n += 1


def mesh_size(cell: torch.Tensor, spacing: float, order: int) -> list[int]:
    """Mesh points along each lattice vector: ``ceil(|a_i| / spacing)``, made FFT-friendly.

    Chosen on the detached cell; at least ``2 * order`` so that a B-spline
    never wraps onto itself.
    """
    lengths = cell.detach().norm(dim=1).tolist()
    return [smooth_size(max(2 * order, math.ceil(length / spacing - 1e-9))) for length in lengths]


def _centred_bspline(order: int, x: float) -> float:
    """Centred cardinal B-spline of ``order`` (support ``|x| < order / 2``) at ``x``."""
    # M_p(y) = 1/(p-1)! sum_k (-1)^k C(p, k) (y - k)_+^(p-1), shifted by p/2 to centre it.
    y = x + order / 2.0
    total = sum((-1) ** k * math.comb(order, k) * max(y - k, 0.0) ** (order - 1) for k in range(order + 1))
    return total / math.factorial(order - 1)


def bspline_influence(n: int, order: int, half: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """``1 / |b(m)|^2`` along one mesh axis, for ``m`` in FFT (``half``: rFFT) layout.

    ``b(m) = sum_j W(j) exp(2 pi i m j / n)``, the DFT of the centred B-spline
    sampled at the mesh points; symmetric, so a cosine sum.
    """
    reach = order // 2
    j = torch.arange(-reach, reach + 1, dtype=dtype, device=device)
    w = torch.tensor([_centred_bspline(order, float(v)) for v in j.tolist()], dtype=dtype, device=device)
    m = torch.arange(n // 2 + 1 if half else n, dtype=dtype, device=device)
    b = (w[None, :] * torch.cos(2.0 * math.pi * m[:, None] * j[None, :] / n)).sum(dim=1)
    return 1.0 / (b * b)


def influence(m0: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, sizes, order: int, dtype, device) -> torch.Tensor:
    """``1 / |b(m)|^2`` of the 3-D mesh at the integer rFFT frequencies ``m0, m1, m2`` (broadcast)."""
    b0 = bspline_influence(sizes[0], order, False, dtype, device)[m0 % sizes[0]]
    b1 = bspline_influence(sizes[1], order, False, dtype, device)[m1 % sizes[1]]
    b2 = bspline_influence(sizes[2], order, True, dtype, device)[m2]
    return b0 * b1 * b2


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values with the same dtype on the same device (a cached kernel's cell)."""
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def _periodic_cover(first: torch.Tensor, n: int, order: int) -> tuple[int, int]:
    """Shortest periodic interval ``(start, length)`` of an ``n``-point axis holding ``[f, f + order)`` for every ``f``.

    The interval starts after the largest gap between the occupied first
    points (taken around the circle); if it would cover the axis, the whole axis.
    """
    if first.numel() == 0:
        return 0, 0
    points = (torch.bincount(first, minlength=n) > 0).nonzero().squeeze(1)  # sorted; a quarter of torch.unique's time
    gaps = torch.diff(points, append=points[:1] + n)  # gap after each point, the last one wrapping around
    widest = int(torch.argmax(gaps))
    length = n - int(gaps[widest]) + order
    if length >= n:
        return 0, n
    return int(points[(widest + 1) % points.numel()]), length


class Stencil:
    """The B-spline support of a set of atoms, as one periodic box of mesh points, and the kernels on it.

    ``lo`` / ``extent`` describe the smallest box (per axis, wrapping
    periodically) holding every atom's ``order`` support points; an axis the
    atoms span entirely becomes the whole axis (``whole_mesh``: every axis).
    Its cost is one sort per axis of the atoms' first support points.
    """

    def __init__(
        self, cell: torch.Tensor, positions: torch.Tensor, sizes, order: int, whole_mesh: bool = False, inverse: torch.Tensor | None = None
    ) -> None:
        sizes = tuple(int(n) for n in sizes)
        # differentiable: forces and strain derivative flow through it; ``inverse``: ``cell^-1`` when known already
        self.u = mesh_coordinates(positions, cell, sizes, inverse)
        self.first = support_start(self.u, order)
        if whole_mesh:
            self.box = SplineBox(order, sizes)
        else:
            first = self.first.long()
            boxes = [_periodic_cover(first[:, d] % sizes[d], sizes[d], order) for d in range(3)]
            self.box = SplineBox(order, sizes, tuple(b[0] for b in boxes), tuple(b[1] for b in boxes))
        self.lo, self.extent = self.box.lo, self.box.extent

    def use_box(self, lo, extent) -> None:
        """Spread onto / interpolate from a larger box holding this one (a transform's cached, padded box)."""
        self.box = SplineBox(self.box.order, self.box.sizes, lo, extent)
        self.lo, self.extent = self.box.lo, self.box.extent
        check_inside(self.first, self.box)

    def spread(self, q: torch.Tensor) -> torch.Tensor:
        """The box of mesh charges ``sum_i q_i W_i`` of these atoms (no autograd: see :class:`_ReciprocalShares`)."""
        return spread_values(self.u, self.first, q, self.box).reshape(self.extent)

    def interpolate(self, box: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A box of mesh values at the atoms ``(N,)`` and its gradient in mesh coordinates ``(N, 3)`` (no autograd)."""
        return gather_values(self.u, self.first, box, self.box)


def half_spectrum_multiplicity(m2: torch.Tensor, n2: int) -> torch.Tensor:
    """How many k-points of the full spectrum each rFFT k-point stands for: 1 on the ``m2 = 0`` and Nyquist planes, else 2."""
    return torch.where((m2 == 0) | (2 * m2 == n2), 1, 2)


class CotangentCheck(torch.autograd.Function):
    """Identity on the energies; its backward reports whether this rank's cotangent is not all ones.

    A particle-mesh energy is quadratic in the mesh values with a symmetric
    kernel, so when every atom's energy has cotangent 1 (a pipeline's summed
    energy) its backward needs no FFT (:class:`~halopipe.models.pme.PME`'s
    ``_ReciprocalShares``). The second input is a zero that went through a
    global sum; this backward sends "my cotangent is not all ones" (0 or 1)
    back through it, so every rank's mesh backward sees the same sum and takes
    the same branch.
    """

    @staticmethod
    def forward(ctx, energies, ranks_not_summed):
        return energies.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_tensor([float(grad.numel() > 0 and not bool((grad == 1).all()))])
