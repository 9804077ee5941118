"""A distributed 3-D real FFT on mesh slabs, differentiable end to end.

Slab decomposition: rank ``r`` holds the real-space planes ``x0 in
[a_r, b_r)`` of an ``(n0, n1, n2)`` mesh (balanced: sizes differ by at most
one, so no mesh size needs to divide by the number of ranks; ranks beyond
``n0`` hold no plane). The forward transform

1. runs the local 1-D real FFT along axis 2 and the complex FFT along axis 1
   on its planes, giving ``(b_r - a_r, n1, n2 // 2 + 1)``;
2. transposes with one ``all_to_all_single``: every rank sends each rank
   ``t`` its planes' rows ``y in [c_t, d_t)`` and so ends up with all ``n0``
   planes of its own rows, ``(n0, d_r - c_r, n2 // 2 + 1)``;
3. runs the 1-D FFT along axis 0.

The spectrum is thus distributed over the ``k1`` axis; the inverse runs the
same steps backwards. Each rank holds ``O(M / P)`` numbers and sends
``O(M / P)`` per transpose. Every step is linear with an exact adjoint
(local FFTs through autograd, the transpose through :class:`AllToAll`, whose
backward is the reverse all-to-all), so gradients through the transform are
exact.

:class:`SlabBoxMap` moves a rank's box of mesh values (its atoms' B-spline
support, ghost layer included) to the slab owners, summing on arrival, and
reads a box back from the slabs: the mesh's halo exchange, differentiable
both ways. Box descriptors (six integers per rank) are all-gathered once per
map; the values travel point to point, only between ranks whose box and slab
meet.
"""

from __future__ import annotations

import torch

from ..meshfft import BoxMap, MeshTransform, box_flat_index, signed_frequencies
from .comm import Comm

__all__ = ["SlabMeshTransform", "SlabBoxMap", "AllToAll", "balanced_split"]


def balanced_split(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` consecutive pieces whose sizes differ by at most one."""
    base, extra = divmod(int(n), int(parts))
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _starts(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _fft(fn, x: torch.Tensor, dim: int, norm: str, n: int | None = None) -> torch.Tensor:
    """``fn`` (a 1-D ``torch.fft`` transform) that also accepts a rank's empty share of the mesh.

    FFT libraries reject empty batches; an empty result is built instead, still
    attached to ``x``'s graph so that this rank takes part in the backward
    transposes like every other rank.
    """
    if x.numel():
        return fn(x, dim=dim, norm=norm) if n is None else fn(x, n=n, dim=dim, norm=norm)
    shape = list(x.shape)
    if fn is torch.fft.rfft:
        shape[dim] = shape[dim] // 2 + 1
    elif fn is torch.fft.irfft:
        shape[dim] = n
    real = x.real.dtype if x.is_complex() else x.dtype
    dtype = real if fn is torch.fft.irfft else (torch.complex128 if real == torch.float64 else torch.complex64)
    anchor = 0 * x.sum()
    return torch.zeros(shape, dtype=dtype, device=x.device) + (anchor if dtype.is_complex else anchor.real)


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all of a flat tensor; the backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x, comm: Comm, send_sizes: list[int], recv_sizes: list[int]):
        ctx.comm, ctx.send_sizes, ctx.recv_sizes = comm, send_sizes, recv_sizes
        return comm.all_to_all(x, send_sizes, recv_sizes)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all(grad.contiguous(), ctx.recv_sizes, ctx.send_sizes), None, None, None


class SlabMeshTransform(MeshTransform):
    """The mesh transform of :mod:`halopipe.meshfft`, slab-decomposed over the ranks of ``comm``.

    Parameters
    ----------
    comm : the ranks sharing the mesh.
    sizes : ``(n0, n1, n2)`` mesh points.

    Real space: this rank's planes ``x0 in [a, b)`` as ``(b - a, n1, n2)``.
    Spectrum: this rank's rows ``k1 in [c, d)`` as ``(n0, d - c, n2 // 2 + 1)``.
    """

    def __init__(self, comm: Comm, sizes) -> None:
        self.comm = comm
        self.sizes = tuple(int(s) for s in sizes)
        self.parts = comm.size
        self.planes = balanced_split(self.sizes[0], comm.size)
        self.rows = balanced_split(self.sizes[1], comm.size)
        self.plane_start, self.row_start = _starts(self.planes), _starts(self.rows)
        r = comm.rank
        self.own_planes = (self.plane_start[r], self.plane_start[r] + self.planes[r])
        self.own_rows = (self.row_start[r], self.row_start[r] + self.rows[r])

    # ---------------------------------------------------------- transposes
    def _planes_to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(my planes, n1, h) complex -> (n0, my rows, h): one all-to-all."""
        h, r = x.shape[2], self.comm.rank
        send = torch.view_as_real(x).permute(1, 0, 2, 3).reshape(-1)  # grouped by destination row block
        send_sizes = [rows * self.planes[r] * h * 2 for rows in self.rows]
        recv_sizes = [self.rows[r] * planes * h * 2 for planes in self.planes]
        got = AllToAll.apply(send, self.comm, send_sizes, recv_sizes)
        blocks = [b.reshape(self.rows[r], p, h, 2) for b, p in zip(torch.split(got, recv_sizes), self.planes)]
        return torch.view_as_complex(torch.cat(blocks, dim=1).permute(1, 0, 2, 3).contiguous())

    def _rows_to_planes(self, x: torch.Tensor) -> torch.Tensor:
        """(n0, my rows, h) complex -> (my planes, n1, h): the reverse all-to-all."""
        h, r = x.shape[2], self.comm.rank
        send = torch.view_as_real(x).reshape(-1)  # already grouped by destination plane block
        send_sizes = [planes * self.rows[r] * h * 2 for planes in self.planes]
        recv_sizes = [self.planes[r] * rows * h * 2 for rows in self.rows]
        got = AllToAll.apply(send, self.comm, send_sizes, recv_sizes)
        blocks = [b.reshape(self.planes[r], rows, h, 2) for b, rows in zip(torch.split(got, recv_sizes), self.rows)]
        return torch.view_as_complex(torch.cat(blocks, dim=1).contiguous())

    # ----------------------------------------------------------- interface
    def forward(self, mesh: torch.Tensor) -> torch.Tensor:
        expected = (self.planes[self.comm.rank], self.sizes[1], self.sizes[2])
        if tuple(mesh.shape) != expected:
            raise ValueError(f"SlabMeshTransform.forward: this rank's slab must have shape {expected}, got {tuple(mesh.shape)}")
        x = _fft(torch.fft.fft, _fft(torch.fft.rfft, mesh, dim=2, norm="backward"), dim=1, norm="backward")
        return _fft(torch.fft.fft, self._planes_to_rows(x), dim=0, norm="backward")

    def inverse(self, spectrum: torch.Tensor) -> torch.Tensor:
        x = self._rows_to_planes(_fft(torch.fft.ifft, spectrum, dim=0, norm="forward"))
        return _fft(torch.fft.irfft, _fft(torch.fft.ifft, x, dim=1, norm="forward"), n=self.sizes[2], dim=2, norm="forward")

    def frequencies(self, device=None):
        n0, _, n2 = self.sizes
        c, d = self.own_rows
        m0 = signed_frequencies(n0, device)[:, None, None]
        m1 = signed_frequencies(self.sizes[1], device)[c:d][None, :, None]
        m2 = torch.arange(n2 // 2 + 1, device=device)[None, None, :]
        return m0, m1, m2

    def scatter_full(self, mesh: torch.Tensor) -> torch.Tensor:
        """This rank's planes of a full mesh (for tests and for starting from a replicated mesh)."""
        a, b = self.own_planes
        return mesh[a:b]

    def boxes(self, lo, extent) -> BoxMap:
        return SlabBoxMap(self, lo, extent)


class SlabBoxMap(BoxMap):
    """A rank's periodic box of mesh points mapped onto the slabs (see the module docstring)."""

    def __init__(self, transform: SlabMeshTransform, lo, extent) -> None:
        self.t = transform
        comm, sizes = transform.comm, transform.sizes
        self.extent = tuple(int(e) for e in extent)
        mine = tuple(int(v) for v in lo) + self.extent
        boxes = comm.all_gather_object(mine) if comm.distributed else [mine]
        me = comm.rank
        # What my box sends to each slab: its planes inside that slab (box rows, in box order).
        self.send_rows: dict[int, torch.Tensor] = {}
        # What each box sends to my slab: flat indices into my slab, in the sender's order.
        self.recv_flat: dict[int, torch.Tensor] = {}
        a_me, b_me = transform.own_planes
        for r, box in enumerate(boxes):
            lo_r, ext_r = box[:3], box[3:]
            g0 = (lo_r[0] + torch.arange(ext_r[0])) % sizes[0]
            if r == me:
                for s in range(comm.size):
                    a, b = transform.plane_start[s], transform.plane_start[s] + transform.planes[s]
                    rows = ((g0 >= a) & (g0 < b)).nonzero()[:, 0]
                    if rows.numel() and ext_r[1] * ext_r[2]:
                        self.send_rows[s] = rows
            inside = (g0 >= a_me) & (g0 < b_me)
            if bool(inside.any()) and ext_r[1] * ext_r[2]:
                self.recv_flat[r] = box_flat_index(lo_r, ext_r, (b_me - a_me, sizes[1], sizes[2]), first_axis=g0[inside] - a_me)

    def _scatter_sum(self, box: torch.Tensor) -> torch.Tensor:
        """Box values -> my slab, each mesh point summed over all boxes holding it."""
        t = self.t
        sends = {s: box[rows.to(box.device)] for s, rows in self.send_rows.items()}
        shapes = {r: tuple(flat.shape) for r, flat in self.recv_flat.items()}
        got = t.comm.exchange(sends, shapes, box.dtype, box.device)
        a, b = t.own_planes
        slab = box.new_zeros((b - a) * t.sizes[1] * t.sizes[2])
        for r, flat in self.recv_flat.items():
            slab.index_add_(0, flat.to(box.device).reshape(-1), got[r].reshape(-1))
        return slab.reshape(b - a, t.sizes[1], t.sizes[2])

    def _gather(self, slab: torch.Tensor) -> torch.Tensor:
        """My slab -> every box's values at its points (the adjoint of :meth:`_scatter_sum`)."""
        t = self.t
        flat_slab = slab.reshape(-1)
        sends = {r: flat_slab[flat.to(slab.device).reshape(-1)].reshape(flat.shape) for r, flat in self.recv_flat.items()}
        shapes = {s: (rows.numel(),) + self.extent[1:] for s, rows in self.send_rows.items()}
        got = t.comm.exchange(sends, shapes, slab.dtype, slab.device)
        box = slab.new_zeros(self.extent)
        for s, rows in self.send_rows.items():
            box[rows.to(slab.device)] = got[s]
        return box

    def to_mesh(self, box: torch.Tensor) -> torch.Tensor:
        return _BoxToSlab.apply(box, self)

    def from_mesh(self, mesh: torch.Tensor) -> torch.Tensor:
        return _SlabToBox.apply(mesh, self)


class _BoxToSlab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box, boxmap: SlabBoxMap):
        ctx.boxmap = boxmap
        return boxmap._scatter_sum(box)

    @staticmethod
    def backward(ctx, grad):
        return ctx.boxmap._gather(grad.contiguous()), None


class _SlabToBox(torch.autograd.Function):
    @staticmethod
    def forward(ctx, slab, boxmap: SlabBoxMap):
        ctx.boxmap = boxmap
        return boxmap._gather(slab)

    @staticmethod
    def backward(ctx, grad):
        return ctx.boxmap._scatter_sum(grad.contiguous()), None
