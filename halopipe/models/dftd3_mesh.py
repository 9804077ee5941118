"""D3(BJ) two-body dispersion by particle mesh: the whole periodic sum, with no dispersion cutoff.

D3(BJ)'s two-body energy sums over every pair of atoms and all their periodic
images (an atom with its own images included),

    E2 = -1/2 sum_{i, j, n}' C6_ij [ s6 / (r^6 + R0_st^6) + s8 3 Q_s Q_t / (r^8 + R0_st^8) ],

``s, t`` the elements of ``i, j``, ``r = |r_j + n - r_i|``, ``R0_st = a1 sqrt(3 Q_s Q_t) + a2``.
A cutoff sum of these ``r^-6`` tails converges only as ``rc^-3``. Here, as in
Valeeva et al. (2026, nvalchemi-toolkit-ops' ``fourier_dftd3``):

1. *Separable C6.* ``C6_ij = w_i^T K_st w_j`` with the CN-dependent Gaussian
   weights ``w`` over each element's reference C6 table ``K``. The symmetric
   matrix of ``K`` over the (element, reference) pairs of the elements present is
   scaled by its diagonal and eigendecomposed, ``K = D^1/2 U Lambda U^T D^1/2``;
   keeping the ``L`` eigenpairs of largest ``|lambda|`` that reproduce every
   entry of ``K`` to ``rank_tolerance`` (relative) gives
   ``C6_ij = sum_l lambda_l c_il c_jl``, ``c_il = sum_a w_ia (D^1/2 U)_(s_i a), l``
   (lambda may be negative: its sign is kept). Every ``C6_ij`` is a convex
   combination of entries of ``K``, so each has the same relative error bound.
2. *Mesh channels.* Each (rank slot ``l``, element ``s``) is a mesh channel
   carrying ``rho_ls = sum_{i in s} c_il W_i`` (``W_i``: SPME B-spline weights,
   :mod:`halopipe.kernels.mesh`). Then

       E2 = 1/(2V) sum_k sum_l lambda_l sum_st conj(S_ls(k)) G_st(k) S_lt(k) - E_self,

   ``G_st = -(s6 F6(k; R0_st) + 3 s8 Q_s Q_t F8(k; R0_st)) / |b(m)|^2`` and ``k = 0``
   included (the damped ``r^-6`` is integrable). ``F_n`` is the 3-D Fourier
   transform of ``1 / (r^n + a^n)`` in closed form (residues at the ``n / 2`` poles
   in the upper half plane, :func:`bj_fourier_transform`).
3. *Self term.* The k-sum includes each atom's ``r = 0`` term, so
   ``E_self = 1/2 sum_i C6_ii (-(s6 / R0_ss^6 + 3 s8 Q_s^2 / R0_ss^8))`` is
   subtracted (an atom's periodic images stay: they are part of D3's sum).

Each atom gets ``1/2 sum_l lambda_l c_il phi_l,s_i(r_i)`` minus its self term
(the pair energies half to each atom, as s-dftd3's atom-resolved energies).
Forces and stress are autograd through the B-spline kernels' analytic
backward, the FFTs, the cell in ``G(k)`` and the weights' CN chain. Each atom
spreads its own ``c_il``, so only the owned atoms need a CN. Where Warp loads
and there is no ATM term (:attr:`DFTD3Mesh.lattice_cn`) the CNs are lattice
sums, as :class:`~halopipe.models.dftd3.DFTD3` computes them: every rank holds
every position (one global sum of N rows), walks its owned atoms' partners and
images within the CN cutoff in a Warp kernel, storing each partner's chain
term where memory allows, and the chain forces come back from the stored
terms (or by a second walk) and one global sum; the view then needs no pair
list and no ghost rows.
Otherwise the CNs come from the view's owned-centred pair list (torch) and the
ghost rows' gradients carry the chain forces home. Under domain decomposition the channels run on the view's
``mesh_transform`` (slabs or pencils, :mod:`halopipe.distributed.fft`): each
rank spreads its owned atoms onto the box its B-splines touch, so mesh memory
per rank is ``O(M / P)`` plus the box. The optional ATM term (``s9``) keeps
:class:`~halopipe.models.dftd3.DFTD3`'s real-space three-body sum with its
cutoff (exact C6, ghost CNs refreshed from their owners).

Cost: the CN walk over the ~2,000 partners an atom of a solid has within the
40 bohr CN cutoff (0.24 s of 0.26 s for 4,096 Si atoms at ``accuracy`` 1e-4 on
one CPU thread, AMD EPYC, with the chain terms stored: 28 bytes a pair, 88 MB
there, in slots reused from call to call; beyond
:data:`~halopipe.kernels.dftd3.SPARSE_CHAIN_STORE_BYTES`, and for the stress's
virial, the chain walks again), and ``L x S`` mesh channels (rank x elements
present: 3 for Si, 10 for MgO, 12-21 for C/H/O at 1e-4-1e-5), spread,
transformed, filtered, transformed back and interpolated (0.016 s for Si
4,096). The channels travel as one batch: one batched FFT, and distributed one
message per peer for each box exchange and transpose, whatever their number.
The mesh energy is quadratic in the channel meshes with a symmetric kernel,
so, as PME's, its backward reuses the forward's potentials
(:class:`_MeshDispersion`): no FFT and no mesh message in the backward. The
mesh spacing follows from ``accuracy`` (:func:`default_d3_mesh_spacing`, its
error model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from ase import units

from ..kernels.dftd3 import (
    keeps_chain_terms,
    keeps_sparse_chain_terms,
    lattice_cells,
    lattice_cn_chain,
    lattice_coordination_numbers,
    lattice_kernel_available,
    sparse_chain_capacity,
)
from ..kernels.mesh import gather_values, spread_values
from ..meshfft import LocalMeshTransform, MeshTransform
from ..scratch import ScratchPool
from .base import LocalView, ModelOutput, check_positive_length
from .dftd3 import _C6, DEFAULT_ATM_CUTOFF, DEFAULT_CN_CUTOFF, DFTD3, K1, K3, MAX_Z, coordination_numbers
from .particle_mesh import MAX_MESH_POINTS, CotangentCheck, Stencil, half_spectrum_multiplicity, influence, mesh_size, same_tensor

__all__ = ["DFTD3Mesh", "C6Decomposition", "decompose_c6", "bj_fourier_transform", "default_d3_mesh_spacing", "mesh_error_estimate"]

_MIN_ORDER, _MAX_ORDER = 4, 6
_DECOMPOSITIONS = ("auto", "slab", "pencil")


# ------------------------------------------------------------------ Fourier transform
def bj_fourier_transform(k: torch.Tensor, a: torch.Tensor | float, n: int) -> torch.Tensor:
    """3-D Fourier transform ``F(k) = int d^3r exp(-i k.r) / (r^n + a^n)`` for even ``n >= 4``.

    ``F(k) = (4 pi / k) int_0^inf r sin(kr) / (r^n + a^n) dr``, closed by residues
    at the ``n / 2`` poles ``p_m = a exp(i theta_m)``, ``theta_m = pi (2m + 1) / n``,
    in the upper half plane:

        F(k) = (4 pi^2 / k) Re sum_m exp(i k p_m) / (n p_m^(n-2))
             = (4 pi^2 / k) a^(2-n) / n sum_m exp(-k a sin theta_m) cos(k a cos theta_m - (n - 2) theta_m).

    At ``k = 0`` the limit ``4 pi int_0^inf r^2 / (r^n + a^n) dr = 4 pi^2 a^(3-n) / (n sin(3 pi / n))``
    is taken (through ``torch.where`` on a safe ``k``, so no NaN gradient).
    ``k`` and ``a`` broadcast; both may carry gradients.
    """
    if n < 4 or n % 2:
        raise ValueError(f"bj_fourier_transform: n must be even and >= 4, got {n}")
    a = torch.as_tensor(a, dtype=k.dtype, device=k.device)
    positive = k > 0
    safe = torch.where(positive, k, torch.ones_like(k))
    ka = safe * a
    total = torch.zeros_like(ka)
    for m in range(n // 2):  # the n/2 poles, not atoms
        theta = math.pi * (2 * m + 1) / n
        total = total + torch.exp(-ka * math.sin(theta)) * torch.cos(ka * math.cos(theta) - (n - 2) * theta)
    value = (4.0 * math.pi**2 / n) * a ** (2 - n) * total / safe
    at_zero = (4.0 * math.pi**2 / (n * math.sin(3.0 * math.pi / n))) * a ** (3 - n)
    return torch.where(positive, value, at_zero.expand_as(value))


# ------------------------------------------------------------------ low-rank C6
@dataclass(frozen=True)
class C6Decomposition:
    """``C6ref(Z_s, Z_t, a, b) ~ sum_l lambda_l V[s, a, l] V[t, b, l]`` over the elements present.

    Attributes
    ----------
    species : (S,) atomic numbers, sorted.
    eigenvalues : (L,) ``lambda_l`` (any sign), largest ``|lambda|`` first.
    vectors : (S, n_max, L) ``V`` (zero beyond an element's references), eV^1/2 Å^3.
    rank : ``L``.
    error : largest relative error of the reconstructed reference entries.
    tolerance : the requested bound on ``error``.
    full_rank : size of the matrix (the rank that reproduces it to rounding).
    """

    species: tuple[int, ...]
    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    rank: int
    error: float
    tolerance: float
    full_rank: int


def decompose_c6(c6ref: torch.Tensor, n_ref: torch.Tensor, species, tolerance: float) -> C6Decomposition:
    """Smallest-rank eigendecomposition of the reference C6 matrix of ``species`` within ``tolerance``.

    The matrix over (element, reference) pairs is scaled to unit diagonal
    (``K' = D^-1/2 K D^-1/2``), so that truncation treats heavy and light
    elements alike; its eigenpairs are taken in order of ``|lambda|`` until
    every entry of ``K`` is reproduced to ``tolerance`` relative error.
    ``ValueError`` when even the full rank misses it (a tolerance below rounding).
    """
    species = tuple(sorted(int(z) for z in species))
    counts = [int(n_ref[z]) for z in species]
    n_max = max(counts)
    index = [(s, a) for s, count in enumerate(counts) for a in range(count)]
    z = torch.tensor([species[s] for s, _ in index])
    a = torch.tensor([a for _, a in index])
    table = c6ref.detach().to(torch.float64).cpu()
    k = table[z[:, None], z[None, :], a[:, None], a[None, :]]
    k = 0.5 * (k + k.T)
    scale = torch.sqrt(torch.diagonal(k))
    lam, u = torch.linalg.eigh(k / scale[:, None] / scale[None, :])
    order = torch.argsort(lam.abs(), descending=True)
    lam, u = lam[order], u[:, order] * scale[:, None]
    error, rank = math.inf, 0
    for rank in range(1, lam.numel() + 1):  # the matrix is small (tens of references)
        approx = (u[:, :rank] * lam[:rank]) @ u[:, :rank].T
        error = float(((approx - k).abs() / k.abs()).max())
        if error <= tolerance:
            break
    if error > tolerance:
        raise ValueError(
            f"DFTD3Mesh: the reference C6 matrix of Z = {list(species)} cannot be reproduced to rank_tolerance {tolerance:.3g} "
            f"(full rank {lam.numel()} reaches {error:.3g}, float64 rounding); ask for a looser rank_tolerance"
        )
    vectors = torch.zeros(len(species), n_max, rank, dtype=torch.float64)
    vectors[torch.tensor([s for s, _ in index]), a] = u[:, :rank]
    return C6Decomposition(species, lam[:rank].clone(), vectors, rank, error, float(tolerance), int(lam.numel()))


# ------------------------------------------------------------------ mesh accuracy
# Decay rate of the kernel's transform: the r^-8 poles nearest the real axis, Im p = R0 sin(pi / 8).
_DECAY = math.sin(math.pi / 8)
_TRUNCATION = 0.1  # A of the error model below
_INTERPOLATION = {4: 1.0, 5: 0.6, 6: 0.4}  # B_p of the error model below


def mesh_error_estimate(spacing: float, r0_min: float, order: int) -> float:
    """Relative two-body energy error the error model of :func:`default_d3_mesh_spacing` expects."""
    x = spacing / r0_min
    return _TRUNCATION * math.exp(-math.pi * _DECAY / x) + _INTERPOLATION[int(order)] * x ** (int(order) + 1)


def default_d3_mesh_spacing(accuracy: float, r0_min: float, order: int) -> float:
    """Mesh spacing ``h`` (Å) expected to give a relative two-body energy error of ``accuracy``.

    Error model. The kernel's transform decays as ``exp(-k R0 sin(pi / 8))``
    (the poles of ``1 / (r^8 + R0^8)`` nearest the real axis), so what a mesh of
    spacing ``h`` cannot carry beyond its Nyquist wave number ``pi / h`` is
    about ``exp(-pi sin(pi / 8) R0 / h)`` of the sum; on fine meshes the
    B-spline interpolation error of order ``p``, a power of ``h``, takes over:

        err(h) = A exp(-pi sin(pi / 8) R0_min / h) + B_p (h / R0_min)^(p + 1),
        A = 0.1,  B_4 = 1.0,  B_5 = 0.6,  B_6 = 0.4,

    with ``R0_min`` the smallest BJ radius of the element pairs present (the
    slowest-decaying kernel). Fitted (as an upper envelope) to the relative
    energy error against a converged mesh of rattled Si (64 atoms), MgO (64)
    and a C/H/O molecular crystal (44), ``h / R0_min`` from 0.08 to 0.2: the
    largest measured errors reach the model; most are 3-30x below (the error
    oscillates in sign with ``h``). Forces measured ``0.1-5 x err x |E| / N``
    per Å (absolute: 5e-6 eV/Å for Si at ``err`` 1e-6). The spacing solves
    ``err(h) = accuracy`` (bisection; ``err`` grows with ``h``) and never
    exceeds ``R0_min / 4``.
    """
    if int(order) not in _INTERPOLATION:
        raise ValueError(f"default_d3_mesh_spacing: the error model covers orders {sorted(_INTERPOLATION)}, got {order}")
    lo, hi = 1e-3 * r0_min, 0.25 * r0_min
    if mesh_error_estimate(hi, r0_min, order) <= accuracy:
        return hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mesh_error_estimate(mid, r0_min, order) <= accuracy else (lo, mid)
    return lo


# ------------------------------------------------------------------ coordination numbers
class _LatticeCoordinationNumbers(torch.autograd.Function):
    """Owned atoms' D3 coordination numbers by lattice sums (Warp); backward: the CN chain, complete on the owned rows.

    Every rank holds every atom's position (one global sum of N rows), its
    threads walk its owned atoms' partners and their images within the CN
    cutoff (:func:`~halopipe.kernels.dftd3.lattice_coordination_numbers`),
    and one global sum of N values brings the coordination numbers home, as
    :class:`~halopipe.models.dftd3.DFTD3` does. No image is a row of the view,
    so the view needs no pair list and no ghost rows. The backward takes any
    ``dE/dCN`` of the owned atoms (a vector-Jacobian product, not only the
    total energy's): its global sum gives every atom's, the chain walk
    (:func:`~halopipe.kernels.dftd3.lattice_cn_chain`) this rank's share of the
    forces on all atoms, and a global sum the complete forces on the owned
    rows; the cell gets the rest of this rank's strain derivative,
    ``cell^T G = sum d (x) dE/dd + rows^T forces``, so that
    ``rows^T dE/drows + cell^T G`` sums over ranks to ``dE/d(strain)``.
    """

    @staticmethod
    def forward(ctx, rows, cell, model, view):
        f64, n = torch.float64, view.n_owned
        owned = view.ids[:n]
        mine = torch.cat([rows.detach().to(f64), view.numbers[:n, None].to(f64)], dim=1)
        packed = view.global_sum(mine.new_zeros(view.n_total, 4).index_copy(0, owned, mine))
        positions, numbers = packed[:, :3], packed[:, 3].round().to(torch.int64)
        rcov = model.rcov[numbers].to(f64).contiguous()
        cells = lattice_cells(positions, cell.detach().to(f64), view.pbc, model.cn_cutoff)
        threads = owned.to(torch.int32).contiguous()
        virial = bool(ctx.needs_input_grad[1])
        # Keep each (thread, partner) pair's chain terms from this walk where they fit, so that the backward is one
        # contraction instead of a second walk: a dense (threads, atoms) table for small systems, else each thread's
        # partners in slots (falling back to the walk when a thread has more partners than slots).
        keep, capacity = ctx.needs_input_grad[0] or virial, None
        if keep and not keeps_chain_terms(n, view.n_total):
            capacity = sparse_chain_capacity(view.n_total, float(torch.linalg.det(cell.detach()).abs()), model.cn_cutoff)
            keep = keeps_sparse_chain_terms(n, capacity)
        share, kept = lattice_coordination_numbers(threads, cells, rcov, K1, keep, virial, capacity if keep else None, model.scratch)
        ctx.state = (view, cells, threads, rcov, kept, virial, model)
        ctx.save_for_backward(rows.detach().to(f64), cell.detach().to(f64))
        return view.global_sum(share)[owned].to(rows.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        view, cells, threads, rcov, kept, virial, model = ctx.state
        rows, cell = ctx.saved_tensors
        owned = threads.long()
        cn_grad = view.global_sum(rows.new_zeros(view.n_total).index_copy(0, owned, grad.to(rows.dtype)))
        share, chain_virial = lattice_cn_chain(threads, cells, rcov, K1, cn_grad, virial, kept)
        if kept is not None and len(kept) == 4:  # the sparse slots, read: the next walk may fill them
            model.scratch.give(kept[0], kept[2])
        forces = view.global_sum(share)[owned]
        grad_cell = torch.linalg.solve(cell.T, chain_virial + rows.T @ forces).to(grad.dtype) if ctx.needs_input_grad[1] else None
        return (-forces).to(grad.dtype), grad_cell, None, None


# ------------------------------------------------------------------ model
class DFTD3Mesh(DFTD3):
    """D3(BJ) dispersion with the two-body sum on a particle mesh: no dispersion cutoff.

    Parameters
    ----------
    functional : functional whose published D3(BJ) parameters to use (as :class:`~halopipe.models.dftd3.DFTD3`).
    damping : must be ``"bj"``: zero damping has no integrable closed-form
        kernel here (``ValueError``; use :class:`~halopipe.models.dftd3.DFTD3`).
    accuracy : target relative error of the two-body energy from the mesh
        (sets the mesh spacing unless given, :func:`default_d3_mesh_spacing`).
    rank_tolerance : largest relative error allowed in every reference C6 of
        the low-rank decomposition (:func:`decompose_c6`); every pair's C6 then
        has at most this relative error, and so has the two-body energy (all
        its terms have one sign). Default: ``accuracy``.
    mesh_spacing : largest mesh spacing along each lattice vector, Å (overrides ``accuracy``).
    mesh_size : explicit mesh ``(n1, n2, n3)`` (overrides both).
    order : B-spline order, 4 to 6 (6, the default, needs the fewest mesh points for an accuracy).
    cn_cutoff : coordination-number cutoff, Å (the lattice walk's reach; without
        :attr:`lattice_cn`, the view's pair list and halo).
    s9, atm_cutoff : three-body ATM scaling and cutoff: the real-space ATM sum
        of :class:`~halopipe.models.dftd3.DFTD3` with its cutoff (0: off).
    params : overrides of ``s6``, ``s8``, ``a1``, ``a2`` (bohr).
    mesh : ``"auto"``, ``"slab"`` or ``"pencil"``: how ranks share the mesh
        (``view.mesh_transform``'s decomposition; one process holds it whole).
        There is no replicated mode: the mesh is always distributed over ranks.

    Notes
    -----
    A class of its own rather than ``DFTD3(summation="mesh")``: it has other
    parameters (accuracy, mesh, rank tolerance, no two-body cutoff) and
    another contract (forces by autograd only, no two-body pair list, a
    cell-dependent reciprocal kernel, so no direct forces by local autograd),
    so a flag would make every property of :class:`DFTD3` branch. It reuses
    that class's reference tables, parameters and (for ``s9``) its ATM term.
    Choose it for the converged (infinite-cutoff) periodic D3(BJ) energy;
    reproducing a published cutoff convention, or a model trained with one,
    needs the cutoff sum of :class:`DFTD3`. The cell must be periodic along
    all three axes. :attr:`decomposition` holds the last decomposition used
    (its ``rank`` and achieved ``error``).
    """

    direct_forces = False
    half_list = False

    def __init__(
        self,
        functional: str = "pbe",
        damping: str = "bj",
        accuracy: float = 1e-5,
        rank_tolerance: float | None = None,
        mesh_spacing: float | None = None,
        mesh_size: tuple[int, int, int] | None = None,
        order: int = 6,
        cn_cutoff: float = DEFAULT_CN_CUTOFF,
        s9: float = 0.0,
        atm_cutoff: float = DEFAULT_ATM_CUTOFF,
        params: Mapping[str, float] | None = None,
        mesh: str = "auto",
    ) -> None:
        if str(damping).lower() != "bj":
            raise ValueError(
                f"DFTD3Mesh: damping {damping!r} is not supported: the mesh sum needs Becke-Johnson (rational) damping, "
                "whose kernel 1/(r^n + R0^n) has a closed-form Fourier transform; use DFTD3 (cutoff sum) for zero damping"
            )
        super().__init__(functional, "bj", cutoff=cn_cutoff, cn_cutoff=cn_cutoff, s9=s9, atm_cutoff=atm_cutoff, params=params)
        rank_tolerance = accuracy if rank_tolerance is None else rank_tolerance
        for label, value in (("accuracy", accuracy), ("rank_tolerance", rank_tolerance)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value < 1):
                raise ValueError(f"DFTD3Mesh: {label} must be a number in (0, 1), got {value!r}")
        if order not in range(_MIN_ORDER, _MAX_ORDER + 1):
            raise ValueError(f"DFTD3Mesh: order must be {_MIN_ORDER}..{_MAX_ORDER} (B-spline points per axis), got {order}")
        if mesh not in _DECOMPOSITIONS:
            raise ValueError(f"DFTD3Mesh: mesh must be one of {_DECOMPOSITIONS}, got {mesh!r}")
        if mesh_size is not None:
            mesh_size = tuple(int(n) for n in mesh_size)
            if len(mesh_size) != 3 or min(mesh_size) < 2 * order:
                raise ValueError(f"DFTD3Mesh: mesh_size must be three integers >= 2 * order ({2 * order}), got {mesh_size}")
        if mesh_spacing is not None:
            check_positive_length("DFTD3Mesh", "mesh_spacing", mesh_spacing)
        self.accuracy, self.rank_tolerance = float(accuracy), float(rank_tolerance)
        self.order, self.fixed_mesh, self.mesh_mode = int(order), mesh_size, mesh
        self.mesh_spacing = None if mesh_spacing is None else float(mesh_spacing)
        self.decomposition: C6Decomposition | None = None
        self._decompositions: dict[tuple[int, ...], C6Decomposition] = {}
        self._cached_kernel: tuple | None = None
        self.scratch = ScratchPool()  # the CN walk's chain slots, reused from step to step

    # ------------------------------------------------------------ contract
    @property
    def lattice(self) -> bool:
        """No lattice sums: the two-body term is on the mesh, the CNs (and ATM) on the view's rows."""
        return False

    @property
    def lattice_cn(self) -> bool:
        """Coordination numbers by lattice sums (Warp available, no ATM term): the view then needs no pairs and no ghost rows.

        The ATM term reads the ghost rows' CNs and C6 of its real-space triples,
        so with ``s9`` the CNs come from the view's pair list instead (torch).
        """
        return self.s9 == 0.0 and lattice_kernel_available(torch.float64)

    @property
    def interaction_cutoff(self) -> float:
        """The reach of the real-space terms (the two-body sum has none), Å."""
        return max(self.cn_cutoff, self.atm_cutoff if self.s9 != 0.0 else 0.0)

    @property
    def cutoff(self) -> float:
        """The view's pair list and halo: none with :attr:`lattice_cn`, else :attr:`interaction_cutoff`."""
        return 0.0 if self.lattice_cn else self.interaction_cutoff

    @property
    def ghost_forces(self) -> bool:
        return True

    def extra_repr(self) -> str:
        return (
            f"functional={self.functional!r}, accuracy={self.accuracy:g}, rank_tolerance={self.rank_tolerance:g}, "
            f"order={self.order}, cn_cutoff={self.cn_cutoff:.3f}, s9={self.s9}, atm_cutoff={self.atm_cutoff:.3f}"
        )

    # ------------------------------------------------------------ pieces
    def pair_tables(self, species, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(R0_st, 3 Q_s Q_t)`` over the species present, (S, S) each, Å and Å^2."""
        z = torch.as_tensor(species, device=device)
        q = self.q[z].to(dtype)
        qq = 3.0 * q[:, None] * q[None, :]
        return self.params["a1"] * torch.sqrt(qq) + self.params["a2"] * units.Bohr, qq

    def decompose(self, species) -> C6Decomposition:
        """The low-rank decomposition for ``species`` (cached per set of species)."""
        key = tuple(sorted(int(z) for z in species))
        if key not in self._decompositions:
            self._decompositions[key] = decompose_c6(self.c6ref, self.n_ref, key, self.rank_tolerance)
        return self._decompositions[key]

    def mesh(self, cell: torch.Tensor, species) -> list[int]:
        """The mesh for ``cell`` and the species present; ``ValueError`` if unreasonably large."""
        if self.fixed_mesh is not None:
            sizes = list(self.fixed_mesh)
            spacing = float("nan")
        else:
            spacing = self.spacing(species)
            sizes = mesh_size(cell, spacing, self.order)
        if math.prod(sizes) > MAX_MESH_POINTS:
            raise ValueError(
                f"DFTD3Mesh: mesh {sizes} (spacing {spacing:.4g} Å) exceeds {MAX_MESH_POINTS} points; loosen accuracy or raise order"
            )
        return sizes

    def spacing(self, species) -> float:
        """Mesh spacing (Å): ``mesh_spacing`` or the one :func:`default_d3_mesh_spacing` gives for ``accuracy``."""
        if self.mesh_spacing is not None:
            return self.mesh_spacing
        r0, _ = self.pair_tables(species, torch.float64, self.q.device)
        return default_d3_mesh_spacing(self.accuracy, float(r0.min()), self.order)

    def _kernel(self, cell: torch.Tensor, transform: MeshTransform, species: tuple[int, ...]) -> torch.Tensor:
        """``G_st(k) / V`` (S, S, k...) at the k-points this process owns, reused while the cell is constant.

        ``G_st = -(s6 F6(k; R0_st) + 3 s8 Q_s Q_t F8(k; R0_st)) / |b(m)|^2``. A cell
        carrying a graph (stress: the strained cell) gets a fresh kernel on this
        call's graph; a constant cell (an MD step) reuses the cached one, as PME does.
        """
        # One process gets a new LocalMeshTransform per call: key it by its sizes; a distributed transform is cached by its system.
        key = transform.sizes if isinstance(transform, LocalMeshTransform) else transform
        cached = self._cached_kernel
        if cached is not None and not cell.requires_grad and cached[1] == key and cached[3] == species and same_tensor(cached[0], cell):
            return cached[2]
        sizes = transform.sizes
        m0, m1, m2 = transform.frequencies(cell.device)
        reciprocal = 2.0 * math.pi * torch.linalg.inv(cell).T
        kvec = m0[..., None] * reciprocal[0] + m1[..., None] * reciprocal[1] + m2[..., None] * reciprocal[2]
        k_sq = (kvec * kvec).sum(-1)
        nonzero = k_sq > 0
        k = torch.where(nonzero, torch.sqrt(torch.where(nonzero, k_sq, torch.ones_like(k_sq))), torch.zeros_like(k_sq))  # no sqrt'(0)
        influence_m = influence(m0, m1, m2, sizes, self.order, cell.dtype, cell.device)
        r0, qq = self.pair_tables(species, cell.dtype, cell.device)
        shape = (len(species), len(species)) + (1,) * k.dim()
        r0, qq = r0.reshape(shape), qq.reshape(shape)
        p = self.params
        transform_k = p["s6"] * bj_fourier_transform(k, r0, 6) + p["s8"] * qq * bj_fourier_transform(k, r0, 8)
        kernel = -transform_k * influence_m / torch.linalg.det(cell).abs()
        if not cell.requires_grad:
            self._cached_kernel = (cell.detach().clone(), key, kernel, species)
        return kernel

    def _weights(self, numbers: torch.Tensor, cn: torch.Tensor, n_max: int) -> torch.Tensor:
        """Normalised Gaussian CN weights ``w_ia`` (R, n_max), as :class:`~halopipe.models.dftd3._C6` forms them."""
        refcn = self.ref_cn[numbers, :n_max].to(cn.dtype)
        valid = torch.arange(n_max, device=cn.device)[None, :] < self.n_ref[numbers][:, None]
        logits = torch.where(valid, -K3 * (cn[:, None] - refcn) ** 2, torch.full_like(refcn, -math.inf))
        return torch.softmax(logits, dim=1)

    def _global_species(self, view: LocalView) -> tuple[int, ...]:
        """Elements present in the whole system (one small global sum, so every rank decomposes alike)."""
        counts = torch.zeros(MAX_Z + 1, dtype=torch.float64, device=view.positions.device)
        counts = counts.index_add(0, view.numbers[: view.n_owned], torch.ones(view.n_owned, dtype=torch.float64, device=counts.device))
        counts = view.global_sum(counts.detach())
        return tuple(int(z) for z in torch.nonzero(counts > 0.5).squeeze(1).tolist())

    # ------------------------------------------------------------ forward
    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        if direct:
            raise ValueError("DFTD3Mesh: forces come from autograd only (the mesh kernel depends on the cell); put it in an autograd group")
        self._check_numbers(view.numbers)
        if not bool(view.pbc.all()):
            raise ValueError("DFTD3Mesh: the mesh sum needs a cell periodic along all three axes; use DFTD3 for open or slab systems")
        return ModelOutput(energies=self._energies(view))

    def _energies(self, view: LocalView) -> torch.Tensor:
        dtype, n = view.positions.dtype, view.n_owned
        species = self._global_species(view)
        rcov = self.rcov.to(dtype)
        if self.lattice_cn:
            cn = _LatticeCoordinationNumbers.apply(view.positions[:n], view.cell, self, view)
        elif self.s9 != 0.0:
            cn = coordination_numbers(view, rcov, self.cn_cutoff)  # ghost rows' CNs too: the ATM term reads them
        else:
            i, j = view.pairs
            keep = view.distances <= self.cn_cutoff
            i, j, r = i[keep], j[keep], view.distances[keep]
            count = torch.sigmoid(K1 * ((rcov[view.numbers[i]] + rcov[view.numbers[j]]) / r - 1.0))
            cn = torch.zeros(n, dtype=dtype, device=r.device).index_add(0, i, count)
        energies = self._two_body_mesh(view, cn[:n], species)
        if self.s9 != 0.0:
            energies = self._three_body(view, _C6(view.numbers, cn, self.c6ref, self.ref_cn, self.n_ref), energies)
        return energies

    def _two_body_mesh(self, view: LocalView, cn: torch.Tensor, species: tuple[int, ...]) -> torch.Tensor:
        """Owned atoms' two-body energies from the mesh (see the module docstring)."""
        dtype, device, n = view.positions.dtype, view.positions.device, view.n_owned
        if not species:  # no atom anywhere: the same collectives as with atoms, on the CNs' graph, so that peers never wait
            return CotangentCheck.apply(0.0 * cn, view.global_sum((0.0 * cn).sum().reshape(1)))
        dec = self.decompose(species)
        self.decomposition = dec
        numbers = view.numbers[:n]
        lookup = torch.full((MAX_Z + 1,), -1, dtype=torch.int64, device=device)
        lookup[torch.tensor(species, device=device)] = torch.arange(len(species), device=device)
        sidx = lookup[numbers]
        n_max = dec.vectors.shape[1]
        w = self._weights(numbers, cn, n_max)  # (n, n_max)
        vectors = dec.vectors.to(dtype=dtype, device=device)
        c = torch.einsum("ia,ial->il", w, vectors[sidx])  # (n, L)
        lam = dec.eigenvalues.to(dtype=dtype, device=device)

        sizes = self.mesh(view.cell, species)
        transform = view.mesh_transform(sizes, self.mesh_mode) if view.mesh_transform is not None else LocalMeshTransform(sizes)
        local = isinstance(transform, LocalMeshTransform)
        stencil = Stencil(view.cell, view.positions[:n], sizes, self.order, whole_mesh=local)
        boxmap = None
        if not local:
            boxmap = transform.boxes(stencil.lo, stencil.extent)
            stencil.use_box(boxmap.lo, boxmap.extent)
        channels = _Channels(stencil, sidx, len(species), lam, transform, boxmap)
        kernel = self._kernel(view.cell, transform, species)  # (S, S, k...)
        pair_energies, not_summed = _MeshDispersion.apply(stencil.u, c, kernel, channels)
        energies = CotangentCheck.apply(pair_energies, view.global_sum(not_summed))
        # Subtract each atom's r = 0 term, phi_ss(0) C6_ii / 2, which the k-sum includes.
        r0, qq = self.pair_tables(species, dtype, device)
        p = self.params
        diag_r0, diag_qq = torch.diagonal(r0), torch.diagonal(qq)
        at_zero = -(p["s6"] / diag_r0**6 + p["s8"] * diag_qq / diag_r0**8)
        c6_self = (lam * c * c).sum(dim=1)
        return energies - 0.5 * c6_self * at_zero[sidx]


# ------------------------------------------------------------------ mesh channels
class _Channels:
    """The ``L x S`` mesh channels of one evaluation: spread, convolve (batched, maybe distributed), interpolate (no autograd).

    Channel ``l * S + s`` carries ``rho_ls = sum_{i in s} v_il W_i`` for per-atom
    values ``v`` ``(n, L)``; the convolution mixes the channels of one rank
    slot by the kernel, ``phi_ls = sum_t G_st * rho_lt``.
    """

    def __init__(self, stencil: Stencil, species_index: torch.Tensor, n_species: int, lam: torch.Tensor, transform, boxmap) -> None:
        self.stencil, self.lam, self.transform, self.boxmap = stencil, lam, transform, boxmap
        self.n_species, self.rank = n_species, lam.numel()
        self.members = [torch.nonzero(species_index == s).squeeze(1) for s in range(n_species)]  # a loop over species, not atoms
        self.multiplicity = half_spectrum_multiplicity(transform.frequencies(lam.device)[2], transform.sizes[2])

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """Boxes ``(L * S, *extent)`` of the atoms' ``values`` ``(n, L)``, each atom on its element's channels."""
        st = self.stencil
        boxes = [
            spread_values(st.u[atoms], st.first[atoms], values[atoms, slot], st.box) for slot in range(self.rank) for atoms in self.members
        ]
        return torch.stack(boxes).reshape((len(boxes),) + tuple(st.extent))

    def convolve(self, boxes: torch.Tensor, kernel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Potential boxes ``(L * S, *extent)`` and the spectra ``(L, S, k...)`` of ``boxes``: one batched transform each way."""
        spectra = self.transform.forward(boxes if self.boxmap is None else self.boxmap.to_mesh(boxes))
        spectra = spectra.reshape((self.rank, self.n_species) + tuple(spectra.shape[1:]))
        potentials = torch.einsum("st...,lt...->ls...", kernel.to(spectra.dtype), spectra)
        mesh = self.transform.inverse(potentials.reshape((-1,) + tuple(potentials.shape[2:])))
        return (mesh if self.boxmap is None else self.boxmap.from_mesh(mesh)), spectra

    def interpolate(self, potentials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each atom's channels of its element: values ``(n, L)`` and their ``u``-gradients ``(n, L, 3)``."""
        st = self.stencil
        n = st.u.shape[0]
        phi, dphi = st.u.new_zeros(n, self.rank), st.u.new_zeros(n, self.rank, 3)
        for slot in range(self.rank):
            for s, atoms in enumerate(self.members):
                mesh = potentials[slot * self.n_species + s]
                phi[atoms, slot], dphi[atoms, slot] = gather_values(st.u[atoms], st.first[atoms], mesh, st.box)
        return phi, dphi

    def kernel_gradient(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """``w(k) sum_l lambda_l Re[conj(left_ls) right_lt]`` (S, S, k...): the rFFT k-points this process owns, each once."""
        lam = self.lam.reshape((-1,) + (1,) * (left.dim() - 1)).to(left.real.dtype)
        return torch.einsum("ls...,lt...->st...", (lam * left).conj(), right).real * self.multiplicity


class _MeshDispersion(torch.autograd.Function):
    """Owned atoms' mesh pair energies ``1/2 sum_l lambda_l c_il phi_l,s_i(r_i)``; the backward reuses the forward's potentials.

    As PME's reciprocal energy, the mesh energy is quadratic in the channel
    meshes and its kernel symmetric (``G_st = G_ts``, even in ``k``), so when
    every cotangent is 1 (checked globally by
    :class:`~halopipe.models.particle_mesh.CotangentCheck`) the gradient
    needs no FFT and moves no mesh: ``dE/dc_il = lambda_l phi_il``,
    ``dE/du_i = sum_l lambda_l c_il grad phi_il``, ``dE/dG_st(k) = 1/2 w(k)
    sum_l lambda_l Re[conj(S_ls) S_lt]``. Otherwise (per-atom weights ``g``)
    the cotangent meshes ``m_ls = sum_{i in s} g_i c_il W_i / 2`` go through
    the same convolution once: ``dL/dc_il = lambda_l (g_i phi_il / 2 + psi_il)``.
    Each process owns its k-points, so the kernel gradient is all its own.
    """

    @staticmethod
    def forward(ctx, u, c, kernel, channels: _Channels):
        potentials, spectra = channels.convolve(channels.spread(c), kernel)
        phi, dphi = channels.interpolate(potentials)
        ctx.save_for_backward(c, kernel, phi, dphi, spectra)
        ctx.channels = channels
        return 0.5 * (channels.lam * c * phi).sum(dim=1), u.new_zeros(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor, ranks_not_summed: torch.Tensor | None):
        c, kernel, phi, dphi, spectra = ctx.saved_tensors
        channels, lam = ctx.channels, ctx.channels.lam
        if ranks_not_summed is None or float(ranks_not_summed[0]) == 0.0:  # every rank's cotangent is 1
            grad_c, grad_u = lam * phi, torch.einsum("l,il,ilk->ik", lam, c, dphi)
            cotangent_spectra = 0.5 * spectra
        else:
            weighted = 0.5 * grad[:, None] * c
            potentials, cotangent_spectra = channels.convolve(channels.spread(weighted), kernel)
            psi, dpsi = channels.interpolate(potentials)
            grad_c = lam * (0.5 * grad[:, None] * phi + psi)
            grad_u = torch.einsum("l,il,ilk->ik", lam, c, 0.5 * grad[:, None, None] * dphi + dpsi)
        grad_kernel = channels.kernel_gradient(cotangent_spectra, spectra).to(kernel.dtype) if ctx.needs_input_grad[2] else None
        return grad_u if ctx.needs_input_grad[0] else None, grad_c if ctx.needs_input_grad[1] else None, grad_kernel, None
