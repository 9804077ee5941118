"""Smooth particle-mesh Ewald (SPME): the reciprocal Ewald sum on a mesh.

Essmann et al., J. Chem. Phys. 103, 8577 (1995). The explicit sum over
k-vectors of :class:`~halopipe.models.ewald.Ewald` costs ``O(N N_k)``; SPME
instead

1. spreads each charge onto the ``order**3`` nearest points of a regular
   mesh with cardinal B-spline weights ``W_i(x)``, giving a mesh charge ``Q(x)``;
2. convolves it with the Ewald kernel by FFT,
   ``phi = IFFT[ G(m) FFT[Q] ]`` with
   ``G(m) = k_e 4 pi / V exp(-k^2 / (4 alpha^2)) / k^2 B(m)``, ``G(0) = 0``,
   where ``B(m) = 1 / |b(m)|^2`` undoes the B-spline smoothing (the Euler
   exponential-spline factor: ``b(m)`` is the discrete Fourier transform of
   the B-spline sampled at the mesh points);
3. interpolates the mesh potential back to the atoms with the same weights,
   ``phi_i = sum_x W_i(x) phi(x)``, and gives atom ``i`` the energy
   ``q_i phi_i / 2``.

The cost is ``O(N order^3 + M log M)`` for ``M`` mesh points. Real-space,
self and background terms are those of Ewald. Energy, forces and stress are
smooth (B-splines of order ``p`` are ``p - 2`` times continuously
differentiable) and exact derivatives of the discrete energy.

Spreading and interpolation are compiled kernels (:mod:`halopipe.kernels.mesh`:
the centred cardinal B-splines of SPME, torch-pme's ``"P3M"`` weights); the
convolution is ``rfftn``, ``G *``, ``irfftn``. One autograd function
(:class:`_ReciprocalShares`) holds the chain: since the energy is quadratic
in the mesh charge and ``G`` is symmetric, the gradient of the summed
energy needs only the forward's potential and its interpolated gradient
(``dE/dr_i = q_i grad phi(r_i)``, ``dE/dq_i = phi_i``,
``dE/dG = |S(k)|^2 / 2``): the backward does no FFT and moves no mesh.
Positions and cell enter through the mesh coordinates and ``G(k)``,
differentiated by autograd (forces, stress), in float64.

Domain decomposition: two ways to share the mesh
------------------------------------------------
``mesh="replicated"``: each rank spreads its OWNED charges onto a full-size
copy of the mesh; ``view.global_sum`` adds the ranks' meshes (one
all-reduce); every rank filters the whole mesh and interpolates at its owned
atoms. Memory ``O(M)`` and FFT ``O(M log M)`` per rank do not shrink with
ranks; one all-reduce of ``M`` numbers per step (the backward needs none,
above; weighted per-atom shares, whose gradient does, take a second one).

``mesh="distributed"``: ``view.mesh_transform(sizes)`` (see
:mod:`halopipe.meshfft`) shares the mesh in slabs or pencils
(:mod:`halopipe.distributed.fft` picks: pencils when the ranks outnumber the
mesh's first dimension or when they send fewer messages; ``mesh="slab"`` or
``mesh="pencil"`` forces one). Each rank spreads its owned
charges onto the periodic box of mesh points their B-splines touch (its
region plus an ``order``-wide ghost layer); the box values go to the block
owners and are summed there; the distributed FFT (local 1-D FFTs, all-to-all
transposes) gives each rank its k-points, where ``G(m)`` is applied; the
inverse comes back to the blocks and each rank reads its box back and
interpolates at its owned atoms. The backward again reuses the potential
(each rank returns the kernel gradient of its own k-points), so energy,
forces, stress and ``dE/dq`` equal the replicated mesh to rounding, and
memory and bytes per rank are ``O(M / P)`` plus the box.

``mesh="auto"`` (the default) uses the distributed mesh from 40^3 points on
2-3 ranks and from 32^3 on 4 or more (``DISTRIBUTED_MESH_MIN_POINTS``, the
crossover measured by ``benchmarks/pme_mesh.py``, see docs/benchmarks.md; on
2 ranks it fell from 64^3 once the transposes and box maps stopped copying
twice); on one process the mesh is always local.
"""

from __future__ import annotations

import math

import torch

from ..meshfft import LocalMeshTransform, MeshTransform
from .base import LocalView, check_positive_length
from .coulomb import COULOMB_CONSTANT
from .ewald import SplitCoulomb, accuracy_exponent
from .particle_mesh import (
    MAX_MESH_POINTS,
    CotangentCheck,
    Stencil,
    bspline_influence,
    half_spectrum_multiplicity,
    influence,
    mesh_size,
    same_tensor,
)

__all__ = ["PME", "mesh_size", "default_mesh_spacing", "bspline_influence"]

_MAX_ORDER = 5  # default_mesh_spacing is fitted for orders 3..5 (the mesh kernels reach 6)
_MIN_ORDER = 3  # orders 1-2 give discontinuous forces and need absurdly fine meshes
_MESH_MODES = ("auto", "replicated", "distributed", "slab", "pencil")  # the last two force a decomposition
# PME(mesh="auto") crossover by number of ranks sharing the mesh, measured with benchmarks/pme_mesh.py
# (docs/benchmarks.md): on 2 ranks the distributed mesh (in-place transposes, box maps by slices) is as fast
# as the replicated one from ~32^3 and faster above 40^3; on 4 or more it sends fewer bytes and uses less
# memory from 32^3.
DISTRIBUTED_MESH_MIN_POINTS = {2: 40**3, 4: 32**3}


# --------------------------------------------------------------------- mesh
def default_mesh_spacing(alpha: float, accuracy: float, order: int) -> float:
    """Mesh spacing ``h`` (Å) expected to reach ``accuracy`` with B-splines of ``order``.

    SPME interpolation errors shrink as a power of ``alpha h`` (Deserno and
    Holm, J. Chem. Phys. 109, 7678 (1998)). We use an empirical fit of the
    largest force error relative to the largest force, measured against a
    converged Ewald sum on random charged triclinic cells (orders 3 to 5,
    ``alpha h`` from 0.05 to 0.6)::

        error ~ c_p (alpha h)^(p - 1),   c_p = 3^-(p - 1)

    With it, the total PME force error (mesh plus the real-space truncation
    set by ``alpha``) measured 0.3-3 x ``accuracy`` for orders 4 and 5 and
    accuracies 1e-4 to 1e-6. Tight accuracies need fine meshes with cubic
    splines (order 4 at 1e-6: ``alpha h ~ 0.03``); order 5 needs about 3x
    fewer points per axis. The spacing never exceeds the Nyquist spacing
    ``pi / k_max`` of the explicit Ewald sum at the same accuracy.
    """
    p = int(order)
    c = 3.0 ** (-(p - 1))
    h = (accuracy / c) ** (1.0 / max(p - 1, 1)) / alpha
    kmax = 2.0 * accuracy_exponent(accuracy) * alpha
    return min(h, math.pi / kmax)


def spme_kernel(k_sq: torch.Tensor, alpha: float, volume: torch.Tensor, influence: torch.Tensor) -> torch.Tensor:
    """``k_e 4 pi / V exp(-k^2 / (4 alpha^2)) / k^2 B(m)`` at squared wave numbers ``k_sq``; zero at ``k = 0``."""
    safe = torch.where(k_sq > 0, k_sq, torch.ones_like(k_sq))
    g = (4.0 * math.pi * COULOMB_CONSTANT) * torch.exp(-safe / (4.0 * alpha**2)) / safe / volume
    return torch.where(k_sq > 0, g * influence, torch.zeros_like(g))


# -------------------------------------------------------------------- model
class PME(SplitCoulomb):
    """Smooth particle-mesh Ewald electrostatics.

    Parameters
    ----------
    cutoff : real-space cutoff, Å.
    accuracy : target force accuracy: the largest force error relative to
        the largest force (see "Accuracy and LAMMPS" below). Sets ``alpha``
        (as in :class:`~halopipe.models.ewald.Ewald`, via
        :func:`~halopipe.models.ewald.ewald_parameters`) and, unless given, the
        mesh spacing (:func:`default_mesh_spacing`).
    mesh_spacing : largest mesh spacing along each lattice vector, Å.
    mesh_size : explicit mesh ``(n1, n2, n3)`` (overrides ``mesh_spacing``).
    order : B-spline order (number of mesh points per axis each charge
        touches), 3 to 5. 5, LAMMPS's PPPM default, needs about 2.5x fewer
        points per axis than 4 (GROMACS's default) at ``accuracy`` 1e-5.
    alpha : splitting parameter override, 1/Å.
    mesh : how the mesh is shared between ranks: ``"replicated"`` (every rank
        holds the whole mesh; one all-reduce of it), ``"distributed"`` (slabs
        or pencils of the mesh per rank, chosen by
        :func:`halopipe.distributed.fft.choose_grid`, FFT with all-to-all
        transposes; memory ``O(M / P)``), ``"slab"`` or ``"pencil"``
        (distributed with that decomposition) or ``"auto"`` (distributed when
        the ranks sharing the mesh and its size pass the measured
        ``DISTRIBUTED_MESH_MIN_POINTS`` crossover). All give the same result
        to rounding.

    Accuracy and LAMMPS
    -------------------
    LAMMPS's ``kspace_style pppm <a>`` asks for an RMS force error of
    ``a`` times the force between two unit charges 1 Å apart (14.40 eV/Å),
    an absolute target. halopipe's ``accuracy`` is the *largest* error
    relative to the *largest* force, a stricter, scale-free target. Measured
    on rattled NaCl (4,096 ions, cutoff 8 Å, largest force 4.7 eV/Å) against
    a converged Ewald sum: ``PME(8, 1e-4)`` picks 60^3 (order 5) and has an
    RMS error of 1.4e-5 x 14.40 eV/Å, about what LAMMPS ``pppm 1e-5`` asks
    for (LAMMPS picks 54^3 there); ``PME(8, 1e-5)`` picks 120^3 and reaches
    1.1e-5 of the largest force (1.5e-6 in LAMMPS's units). As a rule for
    dense monovalent ionic systems: halopipe ``accuracy`` = 10 x LAMMPS's
    accuracy gives LAMMPS's error and a comparable mesh.

    Consumes the per-atom field ``charges`` (e); the cell must be periodic
    along all three axes. See the module docstring for the replicated-mesh
    cost under domain decomposition.

    Direct forces (a group with ``autograd=False``, for charges that are not
    a wired field): the real-space pairs through the pair kernel's forces,
    each pair of the system once, and the reciprocal forces
    ``-q_i grad phi(r_i)`` from the forward's own interpolation, with no
    autograd graph; the virial, when asked for, in closed form (the pairs'
    ``sum r (x) f``, the reciprocal sum's strain derivative of ``G(k)``, the
    background's ``E 1``).
    """

    direct_forces = True
    ghost_forces = False  # direct forces come back complete on owned rows: the real-space ghost shares are folded home

    def __init__(
        self,
        cutoff: float = 10.0,
        accuracy: float = 1e-6,
        mesh_spacing: float | None = None,
        mesh_size: tuple[int, int, int] | None = None,
        order: int = 5,
        alpha: float | None = None,
        mesh: str = "auto",
    ) -> None:
        super().__init__(cutoff, accuracy, alpha, None)
        if mesh not in _MESH_MODES:
            raise ValueError(f"PME: mesh must be one of {_MESH_MODES}, got {mesh!r}")
        self.mesh_mode = mesh
        if order not in range(_MIN_ORDER, _MAX_ORDER + 1):
            raise ValueError(f"PME: order must be {_MIN_ORDER}..{_MAX_ORDER} (B-spline points per axis), got {order}; 4 is usual")
        if mesh_size is not None:
            mesh_size = tuple(int(n) for n in mesh_size)
            if len(mesh_size) != 3 or min(mesh_size) < order:
                raise ValueError(f"PME: mesh_size must be three integers >= order ({order}), got {mesh_size}")
        if mesh_spacing is not None:
            check_positive_length("PME", "mesh_spacing", mesh_spacing)
        self.order = int(order)
        self.fixed_mesh = mesh_size
        self.mesh_spacing = float(mesh_spacing) if mesh_spacing is not None else default_mesh_spacing(self.alpha, accuracy, self.order)
        self._cached_kernel: tuple | None = None  # (cell, transform, kernel) for the last constant cell
        self._cached_inverse: tuple | None = None  # (cell, cell^-1) for the last constant cell
        self._whole_mesh: dict[tuple, LocalMeshTransform] = {}  # the replicated path's FFT, per mesh size

    def mesh(self, cell: torch.Tensor) -> list[int]:
        """The mesh used for ``cell``; ``ValueError`` if it would be unreasonably large."""
        sizes = list(self.fixed_mesh) if self.fixed_mesh is not None else mesh_size(cell, self.mesh_spacing, self.order)
        if math.prod(sizes) > MAX_MESH_POINTS:
            raise ValueError(
                f"PME: mesh {sizes} (spacing {self.mesh_spacing:.4g} Å) exceeds {MAX_MESH_POINTS} points; "
                "raise order (up to 5), loosen accuracy, or pass a larger mesh_spacing"
            )
        return sizes

    def _inverse(self, cell: torch.Tensor) -> torch.Tensor:
        """``cell^-1``, reused while the cell is unchanged (a cell with a graph, strained for the stress, gets its own)."""
        cached = self._cached_inverse
        if cached is not None and not cell.requires_grad and same_tensor(cached[0], cell):
            return cached[1]
        inverse = torch.linalg.inv(cell)
        if not cell.requires_grad:
            self._cached_inverse = (cell.detach().clone(), inverse)
        return inverse

    def _kernel(self, cell: torch.Tensor, transform: MeshTransform) -> torch.Tensor:
        """``G(m)`` at the k-points ``transform`` gives this process, reused while the cell is unchanged.

        A cell that carries a graph (stress by autograd: the cell is strained)
        gets a fresh kernel carrying this call's graph; a constant cell (an MD
        step) reuses the cached one.
        """
        cached = self._cached_kernel
        if cached is not None and not cell.requires_grad and cached[1] is transform and same_tensor(cached[0], cell):
            return cached[2]
        m0, m1, m2 = transform.frequencies(cell.device)
        k = _wavevectors(self._inverse(cell), transform)  # differentiable in a cell with a graph
        influence_m = influence(m0, m1, m2, transform.sizes, self.order, cell.dtype, cell.device)
        kernel = spme_kernel((k * k).sum(-1), self.alpha, torch.linalg.det(cell).abs(), influence_m)
        if not cell.requires_grad:
            self._cached_kernel = (cell.detach().clone(), transform, kernel)
        return kernel

    def reciprocal(self, view: LocalView, q_owned: torch.Tensor) -> torch.Tensor:
        return self.reciprocal_and_total_charge(view, q_owned)[0]

    def reciprocal_and_total_charge(self, view: LocalView, q_owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Owned reciprocal energies and ``Q``; ``Q`` rides on the small all-reduce of :func:`_reciprocal_shares`."""
        stencil, convolution, kernel = self._mesh_pieces(view)
        return _reciprocal_shares(stencil.u, q_owned, kernel, stencil, convolution, view.global_sum)

    def reciprocal_forces(
        self, view: LocalView, q_owned: torch.Tensor, virial: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Owned reciprocal energies ``q_i phi_i / 2``, forces ``-q_i grad phi(r_i)``, this rank's virial share if asked; no autograd.

        ``grad phi`` is the interpolation's gradient in mesh coordinates
        ``u = n (r @ cell^-1)``, taken to Cartesian by ``du/dr``. Under a
        strain the mesh coordinates, hence ``S(k)``, do not change; only
        ``G(k)`` does (through ``V`` and ``k``), so the virial is
        ``W = sum_k E_k [1 - 2 (1 / k^2 + 1 / (4 alpha^2)) k k]`` with
        ``E_k = |S(k)|^2 G(k) / 2`` over this rank's share of the k-points.
        """
        stencil, convolution, kernel = self._mesh_pieces(view)
        potential, spectrum, share = convolution(stencil.spread(q_owned), kernel)
        phi, dphi = stencil.interpolate(potential)
        sizes = torch.tensor(stencil.box.sizes, dtype=dphi.dtype, device=dphi.device)
        forces = -(q_owned[:, None] * dphi * sizes) @ self._inverse(view.cell).T
        w = None
        if virial:
            energy_k = 0.5 * spectrum.abs().square() * kernel * convolution.multiplicity * share
            k = _wavevectors(self._inverse(view.cell), convolution.transform)
            k_sq = (k * k).sum(-1)
            strain = torch.where(k_sq > 0, 2.0 * (1.0 / torch.where(k_sq > 0, k_sq, 1.0) + 0.25 / self.alpha**2), 0.0)
            w = energy_k.sum() * torch.eye(3, dtype=k.dtype, device=k.device) - torch.einsum("...a,...b,...->ab", k, k, strain * energy_k)
        return 0.5 * q_owned * phi, forces, w

    def _mesh_pieces(self, view: LocalView) -> tuple[Stencil, object, torch.Tensor]:
        """The owned atoms' stencil, the convolution (replicated or distributed mesh) and the kernel ``G`` it uses."""
        sizes = self.mesh(view.cell)
        decomposition = self.mesh_mode if self.mesh_mode in ("slab", "pencil") else "auto"
        transform = view.mesh_transform(sizes, decomposition) if view.mesh_transform is not None else None
        if transform is not None and self._distributes(transform):
            return self._distributed_pieces(view, transform)
        return self._replicated_pieces(view, sizes, alone=transform is not None and transform.parts == 1)

    def _distributes(self, transform: MeshTransform) -> bool:
        """Whether this evaluation uses the distributed mesh (see ``mesh`` in the class docstring)."""
        if self.mesh_mode == "auto":
            thresholds = [points for ranks, points in DISTRIBUTED_MESH_MIN_POINTS.items() if transform.parts >= ranks]
            return bool(thresholds) and math.prod(transform.sizes) >= min(thresholds)
        return self.mesh_mode != "replicated"

    def _replicated_pieces(self, view: LocalView, sizes: list[int], alone: bool = False) -> tuple[Stencil, object, torch.Tensor]:
        """Every rank spreads its owned charges on the whole mesh; one global sum completes it (none when ``alone``: one process)."""
        transform = self._whole_mesh.get(tuple(sizes))
        if transform is None:
            transform = self._whole_mesh[tuple(sizes)] = LocalMeshTransform(sizes)
        stencil = Stencil(view.cell, view.positions[: view.n_owned], sizes, self.order, whole_mesh=True, inverse=self._inverse(view.cell))
        return stencil, _ReplicatedConvolution(transform, None if alone else view.global_sum), self._kernel(view.cell, transform)

    def _distributed_pieces(self, view: LocalView, transform: MeshTransform) -> tuple[Stencil, object, torch.Tensor]:
        """Spread onto this rank's support box, FFT over the ranks' blocks, filter owned k-points, interpolate back."""
        stencil = Stencil(view.cell, view.positions[: view.n_owned], transform.sizes, self.order, inverse=self._inverse(view.cell))
        boxmap = transform.boxes(stencil.lo, stencil.extent)
        stencil.use_box(boxmap.lo, boxmap.extent)
        return stencil, _DistributedConvolution(transform, boxmap), self._kernel(view.cell, transform)


class _ReplicatedConvolution:
    """Charge boxes -> potential on the whole mesh: the ranks' meshes summed (one all-reduce), then ``G *`` by FFT.

    Called with each rank's whole-mesh box; returns the potential mesh (the
    same on every rank), the spectrum ``S`` of the summed charge mesh and this
    rank's share ``1 / P`` of the kernel gradient (every rank holds all
    k-points). ``P`` rides on the all-reduce as one extra element. ``global_sum`` None: a process alone.
    """

    def __init__(self, transform: LocalMeshTransform, global_sum) -> None:
        self.transform, self.global_sum = transform, global_sum
        m2 = transform.frequencies()[2]
        self.multiplicity = half_spectrum_multiplicity(m2, transform.sizes[2])

    def __call__(self, box: torch.Tensor, kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        if self.global_sum is None:  # one process: nothing to sum, and no copy of the mesh to append the counter to
            spectrum = self.transform.forward(box)
            return self.transform.inverse(spectrum * kernel), spectrum, 1.0
        summed = self.global_sum(torch.cat([box.reshape(-1), box.new_ones(1)]))
        spectrum = self.transform.forward(summed[:-1].reshape(box.shape))
        return self.transform.inverse(spectrum * kernel), spectrum, 1.0 / float(summed[-1])


class _DistributedConvolution:
    """Charge boxes -> potential boxes through a distributed mesh: box to blocks, FFT, ``G *``, inverse, blocks to box.

    Each rank owns its own k-points, so its share of the kernel gradient is all of it (1).
    """

    def __init__(self, transform: MeshTransform, boxmap) -> None:
        self.transform, self.boxmap = transform, boxmap
        m2 = transform.frequencies()[2]
        self.multiplicity = half_spectrum_multiplicity(m2, transform.sizes[2])

    def __call__(self, box: torch.Tensor, kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        spectrum = self.transform.forward(self.boxmap.to_mesh(box))
        return self.boxmap.from_mesh(self.transform.inverse(spectrum * kernel)), spectrum, 1.0


def _wavevectors(inverse: torch.Tensor, transform: MeshTransform) -> torch.Tensor:
    """``k = 2 pi m @ cell^-T`` (..., 3) at the k-points ``transform`` gives this process, from ``inverse = cell^-1``."""
    m0, m1, m2 = transform.frequencies(inverse.device)
    reciprocal_cell = 2.0 * math.pi * inverse.T
    return m0[..., None] * reciprocal_cell[0] + m1[..., None] * reciprocal_cell[1] + m2[..., None] * reciprocal_cell[2]


def _reciprocal_shares(u, q, kernel, stencil: Stencil, convolve, global_sum) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_i phi_i / 2`` of the owned atoms (:class:`_ReciprocalShares`) and the total charge ``Q = sum_i q_i``.

    The cotangent check's global sum carries ``Q`` too: one small all-reduce
    each way serves both (the background term needs ``Q``, differentiably).
    """
    energies, not_summed = _ReciprocalShares.apply(u, q, kernel, stencil, convolve)
    summed = global_sum(torch.cat([not_summed, q.sum().reshape(1)]))
    return CotangentCheck.apply(energies, summed[:1]), summed[1]


class _ReciprocalShares(torch.autograd.Function):
    """Owned atoms' reciprocal energies ``q_i phi_i / 2``, with a backward that reuses the forward's potential.

    The reciprocal energy ``E = 1/2 sum_x rho(x) phi(x)``, ``phi = G * rho``, is
    quadratic in the mesh charge, and ``G`` is symmetric. When the energies
    are summed (the cotangent of every share is 1 on every rank: a pipeline's
    energy), the gradient needs nothing beyond the forward:

    * ``dE/du_i = q_i grad phi(u_i)`` and ``dE/dq_i = phi_i`` (half from the
      interpolation, half through the mesh charge);
    * ``dE/dG(k) = 1/2 w(k) |S(k)|^2`` (``w``: rFFT multiplicity), of which
      each rank returns its share, so that the cell derivative (stress)
      summed over ranks is exact.

    So the backward needs no FFT and no mesh communication. Whether every
    cotangent is 1 is a global fact: the second output, a zero, goes through
    ``global_sum`` to :class:`CotangentCheck`, whose backward sends back
    "my cotangent is not all ones" (0 or 1); summed over ranks on its way
    back, it reaches this backward as the gradient of that output, so every
    rank takes the same branch. Otherwise (per-atom weights ``g_i``) the
    exact adjoint runs: the cotangent mesh ``m = sum_i g_i q_i W_i / 2`` goes
    through the same convolution (the operator is self-adjoint), one more
    convolution and its communication.
    """

    @staticmethod
    def forward(ctx, u, q, kernel, stencil: Stencil, convolve):
        potential, spectrum, share = convolve(stencil.spread(q), kernel)
        phi, dphi = stencil.interpolate(potential)
        ctx.save_for_backward(q, kernel, phi, dphi, spectrum)
        ctx.stencil, ctx.convolve, ctx.share = stencil, convolve, share
        return 0.5 * q * phi, u.new_zeros(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor, ranks_not_summed: torch.Tensor | None):
        q, kernel, phi, dphi, spectrum = ctx.saved_tensors
        if ranks_not_summed is None or float(ranks_not_summed[0]) == 0.0:  # every rank's cotangent is 1
            grad_q, grad_u = phi, q[:, None] * dphi
            cotangent_spectrum = 0.5 * spectrum
        else:
            # d/d(mesh charge) of sum_i g_i q_i phi_i / 2 is G * m, m the cotangent mesh sum_i g_i q_i W_i / 2
            potential, cotangent_spectrum, _ = ctx.convolve(ctx.stencil.spread(0.5 * grad * q), kernel)
            psi, dpsi = ctx.stencil.interpolate(potential)
            grad_q = 0.5 * grad * phi + psi
            grad_u = q[:, None] * (0.5 * grad[:, None] * dphi + dpsi)
        grad_kernel = None
        if ctx.needs_input_grad[2]:  # dL/dG(k) = w(k) Re[S(k) conj(M(k))], this rank's share
            grad_kernel = (spectrum * cotangent_spectrum.conj()).real * ctx.convolve.multiplicity * ctx.share
        return grad_u if ctx.needs_input_grad[0] else None, grad_q if ctx.needs_input_grad[1] else None, grad_kernel, None, None
