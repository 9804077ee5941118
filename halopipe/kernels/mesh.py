"""B-spline charge spreading and mesh interpolation of particle-mesh Ewald, as compiled kernels.

An atom at mesh coordinates ``u = n * (r @ cell^-1)`` (per axis, ``n`` mesh
points) touches the ``order`` points ``g = first, ..., first + order - 1``
per axis, ``first = floor(u + order / 2) - (order - 1)``, with the centred
cardinal B-spline weight ``W(u - g) = M_p(u - g + p / 2)`` (the weights of
SPME, Essmann et al. 1995; torch-pme's ``"P3M"`` weights). In 3-D the weight
of a point is the product of its three axis weights.

* :func:`spread_charges`: ``box[g] += q_i W_i(g)``, the mesh charge;
* :func:`interpolate_mesh`: ``phi_i = sum_g W_i(g) box[g]``.

They are each other's adjoint, which gives the analytic backward: spreading's
gradient to the charges is the interpolation of the incoming mesh gradient,
interpolation's gradient to the mesh is the spreading of the incoming per-atom
gradient, and the gradient to ``u`` uses ``dW/du`` (the kernel computes the
interpolated value and its ``u``-gradient in one pass). Positions and cell
enter only through ``u``, computed in torch (:func:`mesh_coordinates`), so
autograd carries forces and the strain derivative (stress) through it.

The mesh may be a periodic box of the mesh (``lo``, ``extent``: a rank's part
in a distributed mesh) or the whole mesh. Warp runs the float64 kernels (one
thread per atom, atomic adds); an eager-torch twin of the same arithmetic runs
for other dtypes, without Warp, or with ``HALOPIPE_KERNELS=torch``.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

from .backend import warp_module
from .pairs import launch

__all__ = [
    "MAX_ORDER",
    "SplineBox",
    "mesh_coordinates",
    "support_start",
    "check_inside",
    "spread_charges",
    "interpolate_mesh",
    "spread_values",
    "gather_values",
]

MAX_ORDER = 6  # local arrays of the Warp kernels hold this many points per axis


@dataclass(frozen=True)
class SplineBox:
    """The periodic box of mesh points that B-splines of ``order`` write to and read from.

    ``sizes`` is the whole mesh; the box starts at mesh index ``lo`` (any
    integer, wrapping) and spans ``extent`` points per axis (the whole mesh
    when omitted). Every atom's support must lie in the box.
    """

    order: int
    sizes: tuple[int, int, int]
    lo: tuple[int, int, int] = (0, 0, 0)
    extent: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.order <= MAX_ORDER:
            raise ValueError(f"SplineBox: order must be 1..{MAX_ORDER}, got {self.order}")
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        if min(self.sizes) < self.order:
            raise ValueError(f"SplineBox: every mesh axis needs at least order ({self.order}) points, got {self.sizes}")
        object.__setattr__(self, "lo", tuple(int(x) for x in self.lo))
        object.__setattr__(self, "extent", self.sizes if self.extent is None else tuple(int(e) for e in self.extent))

    @property
    def points(self) -> int:
        return math.prod(self.extent)


def mesh_coordinates(positions: torch.Tensor, cell: torch.Tensor, sizes, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """``u = n * (r @ cell^-1)``: positions in mesh spacings along each lattice vector (differentiable).

    ``inverse``: ``cell^-1`` when the caller has it (a 3 x 3 inverse costs tens of microseconds on the CPU).
    """
    ns = torch.tensor(list(sizes), dtype=positions.dtype, device=positions.device)
    return ns * (positions @ (torch.linalg.inv(cell) if inverse is None else inverse))


def support_start(u: torch.Tensor, order: int) -> torch.Tensor:
    """First support point per axis, ``floor(u + order / 2) - (order - 1)`` (not wrapped), int32 ``(N, 3)``."""
    return (torch.floor(u.detach() + 0.5 * order) - (order - 1)).to(torch.int32)


def check_inside(first: torch.Tensor, box: SplineBox) -> None:
    """Every support point inside the box (a kernel would write outside it otherwise)."""
    for axis, (n, lo, extent) in enumerate(zip(box.sizes, box.lo, box.extent, strict=True)):
        if extent < n and first.shape[0] and bool((((first[:, axis] - lo) % n) + box.order > extent).any()):
            raise ValueError(f"SplineBox: an atom's B-spline support leaves the box along axis {axis} (lo {lo}, extent {extent})")


# ----------------------------------------------------------------- eager twin
def _axis_weights(u: torch.Tensor, first: torch.Tensor, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights and ``u``-derivatives ``(order, N, 3)`` of the support points ``first + j`` (the kernel's recursion)."""
    f = u + 0.5 * order - (first + (order - 1)).to(u.dtype)
    zero = torch.zeros_like(f)
    c = [torch.ones_like(f)]
    d = [zero]
    for n in range(2, order + 1):
        if n == order:
            d = [c[k] - (c[k - 1] if k else zero) for k in range(n - 1)] + [-c[n - 2]]
        c = [((f + k) * (c[k] if k < n - 1 else zero) + (n - f - k) * (c[k - 1] if k else zero)) / (n - 1) for k in range(n)]
    return torch.stack(c[::-1]), torch.stack(d[::-1])


def _box_index(first: torch.Tensor, box: SplineBox) -> torch.Tensor:
    """Flat box index ``(N, order**3)`` of every support point."""
    steps = torch.arange(box.order, device=first.device)
    lo = torch.tensor(box.lo, device=first.device)
    ns = torch.tensor(box.sizes, device=first.device)
    local = (first.long()[:, None, :] + steps[None, :, None] - lo) % ns  # (N, order, 3)
    e1, e2 = box.extent[1], box.extent[2]
    flat = (local[:, :, None, None, 0] * e1 + local[:, None, :, None, 1]) * e2 + local[:, None, None, :, 2]
    return flat.reshape(first.shape[0], box.order**3)


def _outer(w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Products ``(N, order**3)`` of per-axis factors ``(order, N)``."""
    return (w0.T[:, :, None, None] * w1.T[:, None, :, None] * w2.T[:, None, None, :]).reshape(w0.shape[1], w0.shape[0] ** 3)


def _torch_spread(u, first, q, box: SplineBox) -> torch.Tensor:
    w, _ = _axis_weights(u, first, box.order)
    weights = _outer(w[:, :, 0], w[:, :, 1], w[:, :, 2])
    values = (q[:, None] * weights).reshape(-1)
    return torch.zeros(box.points, dtype=u.dtype, device=u.device).index_add_(0, _box_index(first, box).reshape(-1), values)


def _torch_gather(u, first, mesh, box: SplineBox) -> tuple[torch.Tensor, torch.Tensor]:
    w, dw = _axis_weights(u, first, box.order)
    m = mesh[_box_index(first, box)]  # (N, order**3)
    values = (m * _outer(w[:, :, 0], w[:, :, 1], w[:, :, 2])).sum(dim=1)
    gradients = torch.stack(
        [
            (m * _outer(dw[:, :, 0], w[:, :, 1], w[:, :, 2])).sum(dim=1),
            (m * _outer(w[:, :, 0], dw[:, :, 1], w[:, :, 2])).sum(dim=1),
            (m * _outer(w[:, :, 0], w[:, :, 1], dw[:, :, 2])).sum(dim=1),
        ],
        dim=1,
    )
    return values, gradients


# ----------------------------------------------------------------- Warp
@functools.cache
def compiled_kernels(order: int):
    """The compiled Warp ``(spread, gather)`` of ``order`` (:mod:`._warp_mesh`), or None (with a warning) when Warp cannot build them."""
    wp = warp_module()
    if wp is None:
        return None
    try:
        from ._warp_mesh import mesh_kernels

        kernels = mesh_kernels(order)
        for kernel in kernels:
            wp.load_module(kernel.module, device="cpu")
        return kernels
    except Exception as exc:  # no compiler, unsupported platform: fall back, never crash
        warnings.warn(f"halopipe: Warp mesh kernel build failed ({exc}); PME spreading runs in eager torch", stacklevel=2)
        return None


def _launch(kernel, u, first, box: SplineBox, inputs: list, outputs: list) -> None:
    """Launch ``kernel`` over the atoms on torch's device and stream (tensors passed zero-copy)."""
    wp = warp_module()
    geometry = [wp.vec3i(*box.sizes), wp.vec3i(*box.lo), wp.vec3i(*box.extent)]
    # The mesh geometry follows the atom inputs in both kernels' signatures.
    launch(kernel, u.shape[0], u.device, [u, first, *inputs, *geometry], outputs)


def _warp_kernels(u: torch.Tensor, box: SplineBox):
    """Warp's ``(spread, gather)`` for this call, or None for the eager twin (not float64, or no Warp)."""
    return compiled_kernels(box.order) if u.dtype == torch.float64 else None


def spread_values(u: torch.Tensor, first: torch.Tensor, q: torch.Tensor, box: SplineBox) -> torch.Tensor:
    """Flat box ``(prod(extent),)`` of ``sum_i q_i W_i(g)`` (no autograd)."""
    u, q, first = u.detach().contiguous(), q.detach().to(u.dtype).contiguous(), first.contiguous()
    kernels = _warp_kernels(u, box)
    if kernels is None:
        return _torch_spread(u, first, q, box)
    out = torch.zeros(box.points, dtype=u.dtype, device=u.device)
    if u.shape[0]:
        _launch(kernels[0], u, first, box, [q], [out])
    return out


def gather_values(u: torch.Tensor, first: torch.Tensor, mesh: torch.Tensor, box: SplineBox) -> tuple[torch.Tensor, torch.Tensor]:
    """``phi_i = sum_g W_i(g) mesh[g]`` ``(N,)`` and ``d phi_i / d u_i`` ``(N, 3)`` of a flat box (no autograd)."""
    u, mesh, first = u.detach().contiguous(), mesh.detach().to(u.dtype).reshape(-1).contiguous(), first.contiguous()
    kernels = _warp_kernels(u, box)
    if kernels is None:
        return _torch_gather(u, first, mesh, box)
    values = torch.empty(u.shape[0], dtype=u.dtype, device=u.device)
    gradients = torch.empty_like(u)
    if u.shape[0]:
        _launch(kernels[1], u, first, box, [mesh], [values, gradients])
    return values, gradients


# ----------------------------------------------------------------- autograd
class _Spread(torch.autograd.Function):
    """Mesh charge of the atoms; backward: interpolation of the mesh gradient (and its ``u``-gradient)."""

    @staticmethod
    def forward(ctx, u, q, first, box: SplineBox):
        ctx.save_for_backward(u, q, first)
        ctx.box = box
        return spread_values(u, first, q, box).reshape(box.extent)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        u, q, first = ctx.saved_tensors
        values, gradients = gather_values(u, first, grad, ctx.box)
        grad_u = q.to(u.dtype)[:, None] * gradients if ctx.needs_input_grad[0] else None
        grad_q = values.to(q.dtype) if ctx.needs_input_grad[1] else None
        return grad_u, grad_q, None, None


class _Interpolate(torch.autograd.Function):
    """Mesh values at the atoms; backward: spreading of the per-atom gradient, and ``dphi/du``."""

    @staticmethod
    def forward(ctx, u, mesh, first, box: SplineBox):
        values, gradients = gather_values(u, first, mesh, box)
        ctx.save_for_backward(u, first, gradients)
        ctx.box, ctx.mesh_dtype = box, mesh.dtype
        return values

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        u, first, gradients = ctx.saved_tensors
        grad_u = grad[:, None] * gradients if ctx.needs_input_grad[0] else None
        grad_mesh = spread_values(u, first, grad, ctx.box).reshape(ctx.box.extent).to(ctx.mesh_dtype) if ctx.needs_input_grad[1] else None
        return grad_u, grad_mesh, None, None


def spread_charges(u: torch.Tensor, q: torch.Tensor, first: torch.Tensor, box: SplineBox) -> torch.Tensor:
    """The box of mesh charges ``sum_i q_i W_i(g)``, shape ``box.extent``; differentiable in ``u`` and ``q``.

    Parameters
    ----------
    u : mesh coordinates ``(N, 3)`` (:func:`mesh_coordinates`).
    q : charges (or any per-atom weights) ``(N,)``.
    first : :func:`support_start` of ``u``.
    box : the mesh box written to.
    """
    check_inside(first, box)
    return _Spread.apply(u, q, first, box)


def interpolate_mesh(u: torch.Tensor, mesh: torch.Tensor, first: torch.Tensor, box: SplineBox) -> torch.Tensor:
    """Mesh values interpolated at the atoms, ``sum_g W_i(g) mesh[g]`` ``(N,)``; differentiable in ``u`` and ``mesh``.

    ``mesh`` holds the box's values, shape ``box.extent``; the other arguments as in :func:`spread_charges`.
    """
    if tuple(mesh.shape) != box.extent:
        raise ValueError(f"interpolate_mesh: mesh of shape {tuple(mesh.shape)} for a box of extent {box.extent}")
    check_inside(first, box)
    return _Interpolate.apply(u, mesh, first, box)
