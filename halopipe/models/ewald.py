"""Ewald summation: exact periodic Coulomb energy, split into two fast sums.

The Coulomb energy of a periodic, charge-neutral lattice converges only
conditionally. Ewald's trick splits ``1/r = erfc(alpha r)/r + erf(alpha r)/r``:
the first part is short-ranged and summed directly over pairs within a cutoff,
the second is smooth and summed in reciprocal space. With ``k_e`` the Coulomb
constant, ``V`` the volume and ``Q = sum_i q_i``::

    E_real  = k_e/2 sum_i sum_{j, |r_ij| < r_c} q_i q_j erfc(alpha r_ij) / r_ij
    E_recip = k_e 2 pi / V sum_{k != 0} exp(-k^2 / (4 alpha^2)) / k^2 |S(k)|^2,
              S(k) = sum_j q_j exp(i k.r_j)
    E_self  = -k_e alpha / sqrt(pi) sum_i q_i^2
    E_bg    = -k_e pi Q^2 / (2 V alpha^2)      (neutralising background, Q != 0)

Each owned atom receives its own share of every term: half of each
real-space pair (a compiled half-list kernel, :mod:`halopipe.kernels`), ``q_i^2`` of the self term, ``q_i Q`` of the background term
and, for the reciprocal sum,
``e_i = k_e 4 pi / V sum_{k in half space} f(k) q_i Re[exp(-i k.r_i) S(k)]``
(``k`` and ``-k`` give the same term, so one half of k-space is summed twice).
Under domain decomposition a rank builds ``S(k)`` from its owned atoms and
``view.global_sum`` adds the ranks' parts, differentiably, so forces and
stress come from one backward pass through all ranks.

:func:`ewald_parameters` chooses ``alpha`` and the reciprocal cutoff from a
requested accuracy; :class:`Ewald` sums the reciprocal part explicitly over
k-vectors (cost ``O(N N_k)``, best for small cells),
:class:`~halopipe.models.pme.PME` on a mesh with FFTs.
"""

from __future__ import annotations

import math

import torch

from ..kernels.coulomb import DampedCoulomb, coulomb_terms
from ..kernels.ewald import real_space_energies_autograd
from ..kernels.pairs import HalfListCache
from .base import (
    LocalView,
    Model,
    ModelOutput,
    add_to_owned,
    check_positive_length,
    fold_ghost_shares,
    pair_energies_once,
    virial_from_forces,
)
from .coulomb import COULOMB_CONSTANT

__all__ = [
    "Ewald",
    "SplitCoulomb",
    "ewald_parameters",
    "accuracy_exponent",
    "self_energies",
    "background_energies",
    "require_periodic",
    "half_space_kvectors",
    "reciprocal_energies",
    "kspace_weights",
]

# Upper bound on (owned atoms x k-vectors) elements held at once by Ewald; above it
# the k-vectors are processed in chunks.
_CHUNK_ELEMENTS = 1 << 22


# ------------------------------------------------------------------ parameters
def accuracy_exponent(accuracy: float) -> float:
    """The reduced cutoff ``s = sqrt(-ln(accuracy))`` shared by both Ewald sums.

    Both truncation errors decay like a Gaussian in a reduced cutoff: Kolafa
    and Perram (Mol. Simul. 9, 351 (1992)) estimate the real-space force error
    as ``~ C_r exp(-(alpha r_c)^2)`` and the reciprocal-space one as
    ``~ C_k exp(-(k_max / 2 alpha)^2)``, where the prefactors ``C`` (charges,
    density, powers of the reduced cutoff) are of order one for dense ionic
    systems. Setting both reduced cutoffs to ``s`` with ``exp(-s^2) = accuracy``
    balances the two errors. Measured on random charged triclinic cells, the
    largest force error relative to the largest force is 0.3-2 x ``accuracy``
    from 1e-4 to 1e-8 (and the Madelung energies of the test suite are exact to
    about ``accuracy``).
    """
    if not 0.0 < accuracy < 1.0:
        raise ValueError(f"accuracy must lie in (0, 1), got {accuracy}; e.g. 1e-6")
    return math.sqrt(-math.log(accuracy))


def ewald_parameters(cutoff: float, accuracy: float = 1e-6, alpha: float | None = None, kmax: float | None = None) -> tuple[float, float]:
    """Splitting parameter and reciprocal cutoff for a requested accuracy.

    With ``s = sqrt(-ln(accuracy))`` from :func:`accuracy_exponent` (Kolafa-Perram balance):

    * ``alpha = s / r_c`` makes ``erfc(alpha r) / r`` negligible beyond the
      real-space cutoff ``r_c``;
    * ``k_max = 2 s alpha`` makes ``exp(-k^2 / (4 alpha^2))`` negligible beyond
      ``k_max``.

    Parameters
    ----------
    cutoff : real-space cutoff ``r_c``, Å.
    accuracy : target relative accuracy, e.g. ``1e-6`` (``1e-12`` for
        near machine-precision reference values).
    alpha : override of the splitting parameter, 1/Å; ``k_max`` then follows
        from it as ``2 s alpha``.
    kmax : override of the reciprocal cutoff ``|k| <= k_max``, 1/Å.

    Returns
    -------
    (alpha, kmax) in 1/Å.
    """
    if not (cutoff > 0 and math.isfinite(cutoff)):
        raise ValueError(f"cutoff must be a finite positive number of Å, got {cutoff}")
    s = accuracy_exponent(accuracy)
    if alpha is None:
        alpha = s / cutoff
    elif not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite positive number (1/Å), got {alpha}")
    if kmax is None:
        kmax = 2.0 * s * alpha
    elif not (kmax > 0 and math.isfinite(kmax)):
        raise ValueError(f"kmax must be a finite positive number (1/Å), got {kmax}")
    return float(alpha), float(kmax)


# ------------------------------------------------------------ shared pieces
def require_periodic(view: LocalView, name: str) -> None:
    """Raise ``ValueError`` unless the cell is periodic along all three axes."""
    if not bool(view.pbc.all()):
        raise ValueError(
            f"{name}: Ewald-type sums need a cell periodic along all three axes, got pbc={view.pbc.tolist()}; "
            "use DSFCoulomb for non-periodic or slab systems"
        )


def self_energies(q_owned: torch.Tensor, alpha: float) -> torch.Tensor:
    """``-k_e alpha / sqrt(pi) q_i^2``: removes each Gaussian's interaction with itself."""
    return (-COULOMB_CONSTANT * alpha / math.sqrt(math.pi)) * q_owned * q_owned


def background_energies(q_owned: torch.Tensor, total_charge: torch.Tensor, volume: torch.Tensor, alpha: float) -> torch.Tensor:
    """Shares ``-k_e pi Q q_i / (2 V alpha^2)`` of the neutralising-background energy.

    They sum to ``-k_e pi Q^2 / (2 V alpha^2)``, the energy of a uniform
    background of charge ``-Q`` that the ``k = 0``-free reciprocal sum
    implicitly adds to a charged cell.
    """
    return (-COULOMB_CONSTANT * math.pi / (2.0 * alpha * alpha)) * total_charge * q_owned / volume


# ----------------------------------------------------------------- k-vectors
def half_space_kvectors(cell: torch.Tensor, kmax: float) -> torch.Tensor:
    """Reciprocal vectors ``0 < |k| <= kmax``, one of each ``(k, -k)`` pair, (M, 3).

    ``k = 2 pi n B`` with ``B = (cell^-1)^T`` the reciprocal basis; computed in
    torch from ``cell`` so that the sum is differentiable with respect to it
    (the integer set ``n`` is chosen on the detached cell).
    """
    recip = 2.0 * math.pi * torch.linalg.inv(cell).transpose(0, 1)
    lengths = cell.detach().norm(dim=1)
    # k.a_i = 2 pi n_i, so |n_i| <= kmax |a_i| / (2 pi).
    nmax = [int(math.floor(kmax * float(a) / (2.0 * math.pi))) for a in lengths]
    axes = [torch.arange(-m, m + 1, device=cell.device) for m in nmax]
    n = torch.cartesian_prod(*axes).reshape(-1, 3)
    # Half space: first non-zero integer component positive (drops k = 0 too).
    half = (n[:, 0] > 0) | ((n[:, 0] == 0) & (n[:, 1] > 0)) | ((n[:, 0] == 0) & (n[:, 1] == 0) & (n[:, 2] > 0))
    n = n[half].to(cell.dtype)
    with torch.no_grad():
        keep = (n @ recip.detach()).norm(dim=1) <= kmax
    return n[keep] @ recip


def kspace_weights(cell: torch.Tensor, alpha: float, kmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-space k-vectors (M, 3) and their weights ``k_e 4 pi / V exp(-k^2 / 4 alpha^2) / k^2`` (M,)."""
    volume = torch.linalg.det(cell).abs()
    k = half_space_kvectors(cell, kmax)
    k2 = (k * k).sum(dim=1)
    # Half space: the (k, -k) pair doubles 2 pi / V into 4 pi / V.
    return k, (4.0 * math.pi * COULOMB_CONSTANT) * torch.exp(-k2 / (4.0 * alpha * alpha)) / k2 / volume


def reciprocal_energies(
    positions: torch.Tensor, q_owned: torch.Tensor, k: torch.Tensor, weight: torch.Tensor, global_sum, chunk: int
) -> torch.Tensor:
    """Per-owned-atom reciprocal-space Ewald energy (see the module docstring).

    ``positions`` are the owned rows (any lattice image); ``k`` and ``weight``
    come from :func:`kspace_weights`. The phases are formed ``chunk``
    k-vectors at a time (bounding the transient memory); the ranks' partial
    structure factors of all chunks cross ranks in one ``global_sum``.
    """
    starts = range(0, max(k.shape[0], 1), chunk)
    trig = []
    for start in starts:
        phase = positions @ k[start : start + chunk].transpose(0, 1)  # (n_owned, chunk)
        trig.append((torch.cos(phase), torch.sin(phase)))
    local = torch.cat([torch.stack([q_owned @ cos, q_owned @ sin]) for cos, sin in trig], dim=1)
    s = global_sum(local)  # Re and Im of S(k), all k at once
    energies = q_owned.new_zeros(q_owned.shape[0])
    for start, (cos, sin) in zip(starts, trig):
        end = start + cos.shape[1]
        energies = energies + q_owned * ((cos * s[0, start:end] + sin * s[1, start:end]) @ weight[start:end])
    return energies


# --------------------------------------------------------------------- models
class SplitCoulomb(Model):
    """Shared machinery of Ewald-type models: real space, self and background terms.

    Subclasses implement :meth:`reciprocal`, the per-owned-atom long-range share.
    """

    inputs = frozenset({"charges"})
    direct_forces = False
    half_list = True
    one_holder_list = True

    def __init__(self, cutoff: float, accuracy: float, alpha: float | None, kmax: float | None) -> None:
        super().__init__()
        check_positive_length(self.name, "cutoff", cutoff)
        try:
            self.alpha, self.kmax = ewald_parameters(cutoff, accuracy, alpha, kmax)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        self.cutoff, self.accuracy = float(cutoff), float(accuracy)
        self._half = HalfListCache()  # the HalfList of the last rebuild

    def real_space(self, view: LocalView, charges: torch.Tensor) -> torch.Tensor:
        """Real-space energy per row: half of ``k_e q_i q_j erfc(alpha r) / r`` per pair end (compiled kernel, each pair once).

        Ghost rows hold their owners' shares (:func:`~halopipe.models.base.pair_energies_once`).
        """

        def energies(half, n: int) -> torch.Tensor:
            return real_space_energies_autograd(view.positions, charges, half, self.cutoff, self.alpha, COULOMB_CONSTANT, n)

        return pair_energies_once(view, self._half, energies)

    def reciprocal(self, view: LocalView, q_owned: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def reciprocal_and_total_charge(self, view: LocalView, q_owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`reciprocal` and the total charge ``Q`` (a global sum; a subclass may carry it on a collective of its own)."""
        return self.reciprocal(view, q_owned), view.global_sum(q_owned.sum())

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        require_periodic(view, self.name)
        if direct:
            return self._direct(view)
        q = view.fields["charges"].to(view.positions.dtype)
        q_owned = q[: view.n_owned]
        volume = torch.linalg.det(view.cell).abs()
        reciprocal, total_charge = self.reciprocal_and_total_charge(view, q_owned)
        owned = self_energies(q_owned, self.alpha) + background_energies(q_owned, total_charge, volume, self.alpha) + reciprocal
        return ModelOutput(energies=add_to_owned(self.real_space(view, q), owned))

    def reciprocal_forces(
        self, view: LocalView, q_owned: torch.Tensor, virial: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # pragma: no cover - interface
        """Owned reciprocal energies, forces and (if asked) virial share without autograd (subclasses with ``direct_forces``)."""
        raise NotImplementedError

    def _direct(self, view: LocalView) -> ModelOutput:
        """Forces (owned rows), energies and virial as the view asks, for fixed charges (see :class:`~halopipe.models.PME`).

        Real space over the one-holder list, the ghost ends' shares folded
        home, its virial the pairs' ``sum r (x) f``; the self term exerts no
        force and does not strain; the background term exerts no force and
        strains as ``1 / V`` (virial ``E_bg 1``), so ``Q`` is summed over
        ranks only when energies or virial are wanted.
        """
        q = view.fields["charges"].to(view.positions.dtype)
        n = view.n_owned
        q_owned = q[:n]
        once = self._half.get(view, one_holder=True)
        pair = DampedCoulomb(self.cutoff, self.alpha, COULOMB_CONSTANT)
        row_energies, row_forces, _ = coulomb_terms(view.positions, q, once, pair, view.positions.new_ones(view.n_rows), charge_grad=False)
        forces, real = fold_ghost_shares(view, row_forces, row_energies if view.need_energy else None)
        reciprocal, reciprocal_forces, virial = self.reciprocal_forces(view, q_owned, view.need_virial)
        forces = forces + reciprocal_forces
        energies = None
        if view.need_energy or view.need_virial:
            volume = torch.linalg.det(view.cell).abs()
            background = background_energies(q_owned, view.global_sum(q_owned.sum()), volume, self.alpha)
        if view.need_energy:
            energies = real + self_energies(q_owned, self.alpha) + background + reciprocal
        if view.need_virial:
            centre = view.positions[:n].mean(dim=0) if n else view.positions.new_zeros(3)  # less cancellation far from the origin
            eye = torch.eye(3, dtype=virial.dtype, device=virial.device)
            virial = virial + virial_from_forces(view.positions - centre, row_forces) + background.sum() * eye
        return ModelOutput(energies=energies, forces=forces, virial=virial)

    def extra_repr(self) -> str:
        return f"cutoff={self.cutoff}, accuracy={self.accuracy:g}, alpha={self.alpha:.6g}, kmax={self.kmax:.6g}"


class Ewald(SplitCoulomb):
    """Ewald summation with an explicit reciprocal-space sum.

    Parameters
    ----------
    cutoff : real-space cutoff, Å.
    accuracy : target relative accuracy; sets ``alpha`` and ``kmax`` through
        :func:`ewald_parameters` (``alpha = s / cutoff``, ``kmax = 2 s alpha``,
        ``exp(-s^2) = accuracy``); roughly the largest force error relative to
        the largest force.
    alpha : splitting parameter override, 1/Å.
    kmax : reciprocal cutoff override (largest ``|k|`` summed), 1/Å.

    Consumes the per-atom field ``charges`` (e); the cell must be periodic
    along all three axes. The cost of the reciprocal sum grows as
    ``N * V * kmax^3``; prefer :class:`~halopipe.models.pme.PME` for large cells.
    """

    def __init__(self, cutoff: float = 10.0, accuracy: float = 1e-6, alpha: float | None = None, kmax: float | None = None) -> None:
        super().__init__(cutoff, accuracy, alpha, kmax)
        self._kcache: tuple | None = None  # (cell, k, weight) for the last constant cell

    def _kspace(self, cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k-vectors and weights, reused while the cell is unchanged (a strained cell with a graph gets fresh ones)."""
        cached = self._kcache
        if cached is not None and not cell.requires_grad and cached[0].dtype == cell.dtype and cached[0].device == cell.device:
            if torch.equal(cached[0], cell):
                return cached[1], cached[2]
        k, weight = kspace_weights(cell, self.alpha, self.kmax)
        if not cell.requires_grad:
            self._kcache = (cell.detach().clone(), k, weight)
        return k, weight

    def reciprocal(self, view: LocalView, q_owned: torch.Tensor) -> torch.Tensor:
        k, weight = self._kspace(view.cell)
        chunk = max(1, _CHUNK_ELEMENTS // max(1, view.n_owned))
        return reciprocal_energies(view.positions[: view.n_owned], q_owned, k, weight, view.global_sum, chunk)
