"""Grimme's DFT-D3 dispersion correction (Becke-Johnson and zero damping, optional ATM).

D3 adds to a DFT energy the damped London series of every atom pair,

    E2 = -sum_{pairs} [ s6 C6_ij f6(r_ij) / r_ij^6 + s8 C8_ij f8(r_ij) / r_ij^8 ],

with coefficients that depend on the chemical environment. Each atom's
coordination number (CN) counts its neighbours with a smooth step,

    CN_i = sum_j 1 / (1 + exp(-k1 (R_cov,i + R_cov,j) / r_ij + k1)),  k1 = 16,

(covalent radii of Pyykkö scaled by k2 = 4/3). ``C6_ij`` interpolates a
table of reference C6 computed for each element in a few reference bonding
situations: ``C6_ij = sum_ab w_ia w_jb C6ref(Z_i, Z_j, a, b)`` with Gaussian
weights ``w_ia ∝ exp(-k3 (CN_i - CNref_a)^2)``, k3 = 4, normalised over the
element's references. ``C8 = 3 C6 Q_i Q_j`` with ``Q = sqrt(0.5 <r4>/<r2> sqrt(Z))``.

Damping: Becke-Johnson (``"bj"``, rational) ``f_n / r^n -> 1 / (r^n + R0^n)`` with
``R0 = a1 sqrt(C8/C6) + a2``; zero damping (``"zero"``)
``f_n = 1 / (1 + 6 (r / (rs_n R0AB))^-alpha_n)`` with ``alpha6 = 14, alpha8 = 16``.
The optional three-body Axilrod-Teller-Muto term (``s9``) adds, for each triple,
``s9 sqrt(C6_ij C6_ik C6_jk) (3 cos a cos b cos c + 1) / (r_ij r_ik r_jk)^3``
times ``1 / (1 + 6 (r_mean / (4/3 R0_mean))^-16)`` (geometric means of the three
distances and of their R0AB; the form s-dftd3 uses with either damping).
Triples must have all three distances within ``atm_cutoff``, as in s-dftd3;
they are enumerated as pairs of neighbours of a centre, (neighbours within
``atm_cutoff``)^2 per atom: at the default 21.2 Å a dense solid has about
10^5-10^6 triples per atom.

Periodic images: the cutoffs (50 Å) usually exceed the cell, so the sums run
over lattice translations inside the kernels (:mod:`halopipe.kernels.dftd3`,
"lattice sums"), as s-dftd3 does: every rank holds every atom's position
(one global sum), its threads take their share of its owned atoms' pairs and
triples with all their images, and global sums of per-atom vectors bring the
coordination numbers, ``dE/dCN`` and the forces home. No image is a ghost
row, so D3 asks for no halo. Pair energies are split half/half between the
two atoms, triple energies a third to each (s-dftd3's atom-resolved energies).

Without Warp D3 works on ghost rows in torch: a CN needs all neighbours of
its atom, so CNs are computed for owned rows and ghosts receive theirs from
their owners through ``view.refresh``; a triple gives a third of its energy
to each member as centre, so the sum over owned atoms counts every pair and
triple exactly once. To keep memory bounded on dense solids the owned centres
are taken in chunks of about ``TRIPLE_CHUNK`` candidate triples (at most that
plus one centre's), and each chunk's graph is recomputed in the backward pass
instead of kept (activation checkpointing).

Reference values: Grimme et al., J. Chem. Phys. 132, 154104 (2010), shipped in
``data/dftd3_reference.npz`` (see ``data/README.md``). Units inside: eV and Å.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from ase import units
from torch.utils.checkpoint import checkpoint

from ..kernels.dftd3 import (
    D3Tables,
    keeps_chain_terms,
    lattice_atm,
    lattice_cells,
    lattice_cn_chain,
    lattice_coordination_numbers,
    lattice_kernel_available,
    lattice_neighbours,
    lattice_two_body,
)
from ..kernels.pairs import uniform_scale
from .base import LocalView, Model, ModelOutput, check_positive_length, direct_by_local_autograd

__all__ = ["DEFAULT_ATM_CUTOFF", "DEFAULT_CN_CUTOFF", "DEFAULT_CUTOFF", "DFTD3", "known_functionals"]

_DATA = Path(__file__).parent / "data" / "dftd3_reference.npz"
MAX_Z = 103  # the reference tables end at lawrencium
K1 = 16.0  # steepness of the CN counting function
K2 = 4.0 / 3.0  # scaling of the covalent radii in the CN
K3 = 4.0  # width of the Gaussian CN weighting
RS9 = 4.0 / 3.0  # scaling of R0AB in the ATM damping
ALP = 14.0  # zero-damping exponent alpha6 (alpha8 = alpha6 + 2; ATM uses (alpha6 + 2) / 3)

# LAMMPS pair_style dispersion/d3 (and Grimme's dftd3 program): two-body r^2 < 9000 bohr^2,
# CN r^2 < 1600 bohr^2. The ATM cutoff follows s-dftd3's default of 40 bohr.
DEFAULT_CUTOFF = math.sqrt(9000.0) * units.Bohr  # ≈ 50.20 Å
DEFAULT_CN_CUTOFF = math.sqrt(1600.0) * units.Bohr  # ≈ 21.17 Å
DEFAULT_ATM_CUTOFF = 40.0 * units.Bohr  # ≈ 21.17 Å
# s-dftd3 (through mctc-lib) converts its Å-tabulated covalent radii and R0AB to bohr with CODATA 2018's bohr,
# hbar / (m_e c alpha), while positions reach it in bohr through ASE's constant (CODATA 2014): relative to the
# positions its radii are 6.4e-10 shorter than tabulated. halopipe takes them so, and equals s-dftd3 as ASE users
# call it to ~1e-13 instead of ~5e-8 in forces (the steep CN step and zero damping amplify the radii's difference).
SDFTD3_BOHR = 0.5291772109044924  # Å, CODATA 2018
SDFTD3_LENGTH = units.Bohr / SDFTD3_BOHR
TRIPLE_CHUNK = 1 << 20  # candidate ATM triples per chunk (about 200 MB of float64 intermediates)

_DAMPINGS = ("bj", "zero")


# ------------------------------------------------------------------ reference data
@functools.lru_cache(maxsize=1)
def _reference() -> dict[str, np.ndarray]:
    """The packaged reference tables, unpacked to dense arrays (cached)."""
    with np.load(_DATA, allow_pickle=False) as raw:
        d = {k: raw[k] for k in raw.files}
    n = d["n_ref"].shape[0]
    z = np.arange(n)
    a = np.arange(d["ref_cn"].shape[1])
    lower = z[:, None, None, None] >= z[None, :, None, None]
    valid = (a[None, None, :, None] < d["n_ref"][:, None, None, None]) & (a[None, None, None, :] < d["n_ref"][None, :, None, None])
    c6 = np.zeros((n, n, a.size, a.size))
    c6[lower & valid] = d["c6_packed"]  # boolean assignment fills in C order, as the generator packed
    d["c6"] = np.where(lower, c6, c6.transpose(1, 0, 3, 2))
    r0 = np.zeros((n, n))
    r0[np.tril_indices(n)] = d["r0ab_packed"]
    d["r0ab"] = np.where(lower[:, :, 0, 0], r0, r0.T)
    return d


def known_functionals(damping: str | None = None) -> list[str]:
    """Functional names with D3 parameters (for one damping, or either)."""
    d = _reference()
    cols = [d[x] for x in (_DAMPINGS if damping is None else (damping,))]
    have = np.zeros(len(d["functionals"]), dtype=bool)
    for c in cols:
        have |= ~np.isnan(c).any(axis=1)
    return [str(f) for f, h in zip(d["functionals"], have) if h]


def _functional_parameters(functional: str, damping: str) -> dict[str, float]:
    """s6, s8 and a1, a2 (bohr) or rs6, rs8 of a functional, as published."""
    if damping not in _DAMPINGS:
        raise ValueError(f"DFTD3: unknown damping {damping!r}; use one of {list(_DAMPINGS)}")
    d = _reference()
    name = str(functional).strip().lower()
    aliases = dict(zip(d["alias_from"].tolist(), d["alias_to"].tolist()))
    name = aliases.get(name, name)
    names = d["functionals"].tolist()
    if name not in names:
        raise ValueError(f"DFTD3: unknown functional {functional!r}; known functionals: {', '.join(known_functionals())}")
    row = d[damping][names.index(name)]
    if np.isnan(row).any():
        other = [x for x in _DAMPINGS if not np.isnan(d[x][names.index(name)]).any()]
        raise ValueError(f"DFTD3: no published {damping!r} damping parameters for {functional!r}; available: {other}")
    keys = ("s6", "s8", "a1", "a2") if damping == "bj" else ("s6", "s8", "rs6", "rs8")
    return dict(zip(keys, (float(v) for v in row)))


# ------------------------------------------------------------------------- physics
def coordination_numbers(view: LocalView, rcov: torch.Tensor, cn_cutoff: float) -> torch.Tensor:
    """D3 coordination numbers of all rows: owned rows summed, ghost rows refreshed from owners."""
    i, j = view.pairs
    keep = view.distances <= cn_cutoff
    i, j, r = i[keep], j[keep], view.distances[keep]
    zi, zj = view.numbers[i], view.numbers[j]
    # 1 / (1 + exp(-k1 (rc / r - 1))) written as a sigmoid: no overflow for distant pairs.
    count = torch.sigmoid(K1 * ((rcov[zi] + rcov[zj]) / r - 1.0))
    cn_owned = torch.zeros(view.n_owned, dtype=r.dtype, device=r.device).index_add(0, i, count)
    return view.refresh(cn_owned)


class _C6:
    """CN-dependent C6 of arbitrary row pairs, sharing one contraction per row.

    ``C6_ij = w_i^T C6ref(Z_i, Z_j) w_j``: the first contraction ``w_i^T C6ref(Z_i, t)``
    is done once per row and target species ``t`` present in the view, so each
    pair only costs a dot product over the references of ``Z_j``.
    """

    def __init__(self, numbers: torch.Tensor, cn: torch.Tensor, c6ref: torch.Tensor, ref_cn: torch.Tensor, n_ref: torch.Tensor) -> None:
        species, self.sidx = torch.unique(numbers, return_inverse=True)
        n_max = int(n_ref[species].max()) if species.numel() else 1
        refcn = ref_cn[numbers, :n_max].to(cn.dtype)
        valid = torch.arange(n_max, device=cn.device)[None, :] < n_ref[numbers][:, None]
        logits = torch.where(valid, -K3 * (cn[:, None] - refcn) ** 2, torch.full_like(refcn, -math.inf))
        # Normalised Gaussian weights. softmax subtracts the largest exponent, so a CN far
        # above every reference keeps the highest one instead of underflowing to 0/0 (the
        # fallback s-dftd3 applies; every element with several references has one at CN 0).
        self.w = torch.softmax(logits, dim=1)
        self.species, self.n_ref = species, n_max
        self.table = c6ref[species][:, species, :n_max, :n_max].to(cn.dtype)  # (S, S, n, n)
        self._v: torch.Tensor | None = None

    @property
    def v(self) -> torch.Tensor:
        """``w_i^T C6ref(Z_i, t)`` per row and species present, (R, S, n); formed on first use."""
        if self._v is None:
            v = self.w.new_zeros(self.w.shape[0], self.species.numel(), self.n_ref)
            for s in range(self.species.numel()):  # a loop over species present, not atoms
                rows = (self.sidx == s).nonzero().squeeze(1)
                v = v.index_copy(0, rows, torch.einsum("ra,tab->rtb", self.w[rows], self.table[s]))
            self._v = v
        return self._v

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (self.v[a, self.sidx[b]] * self.w[b]).sum(dim=1)


def _owned_triples(centres: torch.Tensor, n_owned: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All unordered pairs ``(p, q)``, ``p < q``, of pair indices that share an owned centre.

    ``centres`` must be sorted. A pair at rank ``k`` among the ``n`` pairs of its
    centre is combined with the ``n - k - 1`` pairs after it.
    """
    count = torch.bincount(centres, minlength=n_owned)
    start = torch.cumsum(count, 0) - count
    idx = torch.arange(centres.numel(), device=centres.device)
    rank = idx - start[centres]
    partners = count[centres] - rank - 1
    first = torch.repeat_interleave(idx, partners)
    offset = torch.cumsum(partners, 0) - partners
    ramp = torch.arange(first.numel(), device=centres.device) - torch.repeat_interleave(offset, partners)
    return first, first + 1 + ramp


def _chunks_of_triples(centres: torch.Tensor, n_owned: int, limit: int) -> list[tuple[int, int]]:
    """Ranges of the sorted ``centres``' pairs, whole centres each, of about ``limit`` candidate triples.

    A centre with ``n`` pairs has ``n (n - 1) / 2`` candidate triples. A range
    starts where the running total of triples crosses a multiple of ``limit``,
    so it holds at most ``limit`` plus its last centre's triples.
    """
    count = torch.bincount(centres, minlength=n_owned)
    triples = count * (count - 1) // 2
    before = torch.cumsum(triples, 0) - triples  # triples of the centres before each
    chunk = torch.div(before, max(int(limit), 1), rounding_mode="floor")
    ends = torch.cumsum(count, 0)
    last_of_chunk = torch.nonzero(torch.diff(chunk, append=chunk.new_tensor([-1])) != 0).squeeze(1)
    bounds = [0] + ends[last_of_chunk].tolist()
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


class _LatticeSum(torch.autograd.Function):
    """Owned D3 energies by lattice sums, differentiable in the owned rows and the cell (for the strain).

    The forward computes the complete forces on the owned atoms and this
    rank's virial share. Both answer the gradient of the total energy (the
    usual, uniform incoming gradient): the rows get ``-forces``, and the cell
    the rest of this rank's strain derivative, ``cell^T G = -virial + rows^T
    forces``, so that ``rows^T dE/drows + cell^T G`` sums over ranks to
    ``dE/d(strain)``.
    """

    @staticmethod
    def forward(ctx, rows, cell, model, view):
        energies, forces, virial = model._lattice_terms(view, rows.detach(), cell.detach(), cell.requires_grad)
        ctx.save_for_backward(rows.detach().to(forces.dtype), cell.detach().to(forces.dtype), forces)
        ctx.virial = virial
        return energies

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        rows, cell, forces = ctx.saved_tensors
        scale = uniform_scale(grad)
        if scale is None:
            raise RuntimeError(
                "DFTD3: lattice sums differentiate the total energy only, not a weighted sum of per-atom energies; "
                "differentiate the total energy, or run with HALOPIPE_KERNELS=torch for the per-row path"
            )
        grad_cell = None
        if ctx.needs_input_grad[1]:
            grad_cell = scale * torch.linalg.solve(cell.T, -ctx.virial + rows.T @ forces)
        return (-scale * forces).to(grad.dtype), None if grad_cell is None else grad_cell.to(grad.dtype), None, None


class DFTD3(Model):
    """DFT-D3 dispersion energy with Becke-Johnson or zero damping.

    Parameters
    ----------
    functional : functional name whose published D3 parameters to use
        (case-insensitive, s-dftd3 names and aliases, e.g. ``"pbe"``, ``"pbe0"``,
        ``"b3lyp"``, ``"revpbe"``, ``"r2scan"``, ``"tpss"``, ``"blyp"``).
    damping : ``"bj"`` (rational, Becke-Johnson) or ``"zero"``.
    cutoff : two-body cutoff, Å. Default ``sqrt(9000)`` bohr ≈ 50.2 Å (LAMMPS
        ``dispersion/d3`` and the original dftd3 program).
    cn_cutoff : cutoff of the coordination-number sum, Å. Default ``sqrt(1600)``
        bohr ≈ 21.2 Å (LAMMPS, dftd3).
    s9 : scaling of the three-body ATM term (0 = off; 1 is the usual "D3(BJ)-ATM").
    atm_cutoff : cutoff applied to all three distances of an ATM triple, Å.
        Default 40 bohr ≈ 21.2 Å (s-dftd3's default).
    params : optional overrides of the damping parameters (``s6``, ``s8``, and
        ``a1``, ``a2`` [bohr, as published] for BJ or ``rs6``, ``rs8`` for zero).

    Notes
    -----
    Where Warp loads (:attr:`lattice`), the sums run over lattice images in
    compiled kernels: the view needs no pairs and no ghost rows (``cutoff``
    and ``halo`` are 0; :attr:`interaction_cutoff` is the reach), and forces,
    energies and the virial come out of the kernels, complete on the owned
    atoms. Without Warp, the model's ``cutoff`` (its neighbour list and halo)
    is the largest of the three cutoffs, each term masks its own, and forces
    and stress come from torch autograd.
    """

    direct_forces = True  # lattice sums give forces and virial; the ghost-row path differentiates locally

    def __init__(
        self,
        functional: str = "pbe",
        damping: str = "bj",
        cutoff: float = DEFAULT_CUTOFF,
        cn_cutoff: float = DEFAULT_CN_CUTOFF,
        s9: float = 0.0,
        atm_cutoff: float = DEFAULT_ATM_CUTOFF,
        params: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__()
        for label, value in (("cutoff", cutoff), ("cn_cutoff", cn_cutoff), ("atm_cutoff", atm_cutoff)):
            check_positive_length("DFTD3", label, value)
        if not math.isfinite(float(s9)):
            raise ValueError(f"DFTD3: s9 must be a finite number, got {s9!r}")
        damping = str(damping).lower()
        p = _functional_parameters(functional, damping)
        for key, value in dict(params or {}).items():
            if key not in p:
                raise ValueError(f"DFTD3: unknown parameter {key!r} for {damping!r} damping; expected one of {sorted(p)}")
            p[key] = float(value)
        self.functional, self.damping, self.params = str(functional), damping, p
        self.s9 = float(s9)
        self.disp2_cutoff, self.cn_cutoff, self.atm_cutoff = float(cutoff), float(cn_cutoff), float(atm_cutoff)

        d = _reference()
        z = np.arange(d["r4r2"].shape[0], dtype=np.float64)
        # Q_Z = sqrt(0.5 <r4>/<r2> sqrt(Z)) in bohr, to Å; C8 = 3 C6 Q_i Q_j.
        q = np.sqrt(0.5 * d["r4r2"] * np.sqrt(z)) * units.Bohr
        tensors = {
            "c6ref": d["c6"] * units.Hartree * units.Bohr**6,  # Hartree bohr^6 -> eV Å^6
            "ref_cn": d["ref_cn"],
            "n_ref": d["n_ref"],
            "q": q,
            "rcov": K2 * d["rcov"] * SDFTD3_LENGTH,
            "r0ab": d["r0ab"] * SDFTD3_LENGTH,
        }
        for name, value in tensors.items():
            # Derived from the packaged file, so not part of the state dict.
            self.register_buffer(name, torch.as_tensor(value), persistent=False)

    @property
    def lattice(self) -> bool:
        """Lattice sums (Warp available): periodic images are summed in the kernels, never rows of the view."""
        return lattice_kernel_available(torch.float64)

    @property
    def interaction_cutoff(self) -> float:
        """The largest distance any of the terms reaches, Å."""
        return max(self.disp2_cutoff, self.cn_cutoff, self.atm_cutoff if self.s9 != 0.0 else 0.0)

    @property
    def cutoff(self) -> float:
        """The view's pair list and halo: none for lattice sums, else :attr:`interaction_cutoff`."""
        return 0.0 if self.lattice else self.interaction_cutoff

    @property
    def ghost_forces(self) -> bool:
        """Lattice sums return complete forces on the owned atoms; the halo path folds its ghost rows' forces home."""
        return not self.lattice

    def extra_repr(self) -> str:
        return (
            f"functional={self.functional!r}, damping={self.damping!r}, cutoff={self.disp2_cutoff:.3f}, "
            f"cn_cutoff={self.cn_cutoff:.3f}, s9={self.s9}, atm_cutoff={self.atm_cutoff:.3f}"
        )

    # -------------------------------------------------------------- two-body
    def _pair_energy(self, r: torch.Tensor, c6: torch.Tensor, zi: torch.Tensor, zj: torch.Tensor) -> torch.Tensor:
        p = self.params
        qq = 3.0 * self.q[zi].to(r.dtype) * self.q[zj].to(r.dtype)  # C8 / C6, Å^2
        c8 = c6 * qq
        if self.damping == "bj":
            r0 = p["a1"] * torch.sqrt(qq) + p["a2"] * units.Bohr
            return -(p["s6"] * c6 / (r**6 + r0**6) + p["s8"] * c8 / (r**8 + r0**8))
        r0 = self.r0ab[zi, zj].to(r.dtype)
        f6 = 1.0 / (1.0 + 6.0 * (r / (p["rs6"] * r0)) ** (-ALP))
        f8 = 1.0 / (1.0 + 6.0 * (r / (p["rs8"] * r0)) ** (-(ALP + 2.0)))
        return -(p["s6"] * c6 * f6 / r**6 + p["s8"] * c8 * f8 / r**8)

    def _kernel_tables(self, c6_of: _C6, dtype: torch.dtype) -> D3Tables:
        """Per species pair tables of the lattice kernels (the same quantities as :meth:`_pair_energy`).

        ``r0_6``/``r0_8``: ``R0^6``/``R0^8`` (BJ), or ``(rs6 R0AB)^2``/``(rs8 R0AB)^2`` (zero damping).
        """
        p = self.params
        q = self.q[c6_of.species].to(dtype)
        qq = 3.0 * q[:, None] * q[None, :]
        if self.damping == "bj":
            r0 = p["a1"] * torch.sqrt(qq) + p["a2"] * units.Bohr
            q6, q8 = r0**6, r0**8
        else:
            r0 = self.r0ab[c6_of.species][:, c6_of.species].to(dtype)
            q6, q8 = (p["rs6"] * r0) ** 2, (p["rs8"] * r0) ** 2
        flat = lambda x: x.reshape(-1).contiguous()  # noqa: E731
        n_species = int(c6_of.species.numel())
        return D3Tables(flat(qq), flat(q6), flat(q8), n_species, p["s6"], p["s8"])

    def _two_body(self, view: LocalView, c6_of: _C6, energies: torch.Tensor) -> torch.Tensor:
        keep = view.distances <= self.disp2_cutoff
        i, j, r = view.pairs[0][keep], view.pairs[1][keep], view.distances[keep]
        e = self._pair_energy(r, c6_of(i, j), view.numbers[i], view.numbers[j])
        return energies.index_add(0, i, 0.5 * e)  # directed pair (i, j): half to i

    # ------------------------------------------------------------ three-body
    def _three_body(self, view: LocalView, c6_of: _C6, energies: torch.Tensor) -> torch.Tensor:
        """ATM energies of the owned centres, chunk by chunk (see the module docstring on memory)."""
        keep = (view.distances <= self.atm_cutoff).nonzero().squeeze(1)
        centres, order = torch.sort(view.pairs[0][keep], stable=True)
        sel = keep[order]
        nbr, vec, dist = view.pairs[1][sel], view.vectors[sel], view.distances[sel]
        _ = c6_of.v  # the C6 tables are built lazily: build them here, so a recomputed chunk saves what the first pass did
        for lo, hi in _chunks_of_triples(centres, view.n_owned, TRIPLE_CHUNK):
            args = (centres[lo:hi], nbr[lo:hi], vec[lo:hi], dist[lo:hi], c6_of, view.numbers, view.n_owned)
            if torch.is_grad_enabled():  # keep no chunk's graph: recompute it in the backward pass
                energies = energies + checkpoint(self._atm_chunk, *args, use_reentrant=False)
            else:
                energies = energies + self._atm_chunk(*args)
        return energies

    def _atm_chunk(self, centres, nbr, vec, dist, c6_of: _C6, z, n_owned: int) -> torch.Tensor:
        """ATM energies ``(n_owned,)`` of the triples of one chunk's pairs (grouped by owned centre)."""
        p, q = _owned_triples(centres, n_owned)
        v_jk = vec[q] - vec[p]  # r_k - r_i - (r_j - r_i)
        r_jk = torch.linalg.vector_norm(v_jk, dim=1)
        near = r_jk.detach() <= self.atm_cutoff  # s-dftd3 cuts on all three distances
        p, q, r_jk = p[near], q[near], r_jk[near]
        i, j, k = centres[p], nbr[p], nbr[q]
        r2ij, r2ik, r2jk = dist[p] ** 2, dist[q] ** 2, r_jk**2
        # C9 = s9 sqrt(C6 C6 C6) is defined in atomic units (Hartree^(3/2) read as Hartree):
        # with C6 in eV Å^6 one factor sqrt(Hartree) must be divided out.
        c9 = self.s9 * torch.sqrt((c6_of(i, j) * c6_of(i, k) * c6_of(j, k)).abs() / units.Hartree)
        r0 = (RS9**3) * (self.r0ab[z[i], z[j]] * self.r0ab[z[i], z[k]] * self.r0ab[z[j], z[k]]).to(r_jk.dtype)
        r2 = r2ij * r2ik * r2jk
        r1 = torch.sqrt(r2)
        r3 = r1 * r2
        fdamp = 1.0 / (1.0 + 6.0 * (r0 / r1) ** ((ALP + 2.0) / 3.0))
        # (3 cos a cos b cos c + 1) / (r_ij r_ik r_jk)^3 through squared distances only.
        ang = 0.375 * (r2ij + r2jk - r2ik) * (r2ij - r2jk + r2ik) * (-r2ij + r2jk + r2ik) / (r3 * r2) + 1.0 / r3
        return r_jk.new_zeros(n_owned).index_add(0, i, c9 * fdamp * ang / 3.0)  # a third to each member as centre

    # --------------------------------------------------------------- forward
    def _check_numbers(self, numbers: torch.Tensor) -> None:
        bad = (numbers < 1) | (numbers > MAX_Z)
        if bool(bad.any()):
            z = int(numbers[bad][0])
            raise ValueError(
                f"DFTD3: no D3 reference data for atomic number {z}; the tables cover Z = 1..{MAX_Z} (H..Lr): "
                "check the structure's elements, or leave D3 out for this system"
            )

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        if self.lattice:
            self._check_numbers(view.numbers)
            rows, dtype = view.positions[: view.n_owned], view.positions.dtype
            if direct:
                energies, forces, virial = self._lattice_terms(view, rows.detach(), view.cell.detach(), view.need_virial)
                return ModelOutput(
                    energies=energies.to(dtype), forces=forces.to(dtype), virial=None if virial is None else virial.to(dtype)
                )
            return ModelOutput(energies=_LatticeSum.apply(rows, view.cell, self, view).to(dtype))
        if direct:
            return direct_by_local_autograd(self._energies, view)
        return ModelOutput(energies=self._energies(view))

    @torch.no_grad()
    def _lattice_terms(self, view: LocalView, rows: torch.Tensor, cell: torch.Tensor, virial: bool):
        """Owned energies, complete owned forces and this rank's virial share (or None) by lattice sums, in float64.

        Every rank holds every atom's position (one global sum of N rows, not
        a ghost row per image), its threads take their share of its owned
        atoms' pairs and ATM triples (images summed in the kernels), and three
        more global sums of N values bring the coordination numbers,
        ``dE/dCN`` and the forces and energies, which land on every atom of a
        pair or triple, to the owners.
        """
        f64, n = torch.float64, view.n_owned
        owned = view.ids[:n]
        mine = torch.cat([rows.to(f64), view.numbers[:n, None].to(f64)], dim=1)
        packed = view.global_sum(mine.new_zeros(view.n_total, 4).index_copy(0, owned, mine))
        positions, numbers = packed[:, :3], packed[:, 3].round().to(torch.int64)
        cell = cell.to(f64)
        threads = owned.to(torch.int32).contiguous()
        rcov = self.rcov[numbers].to(f64).contiguous()
        cn_cells = lattice_cells(positions, cell, view.pbc, self.cn_cutoff)
        keep = keeps_chain_terms(n, view.n_total)
        cn_share, kept = lattice_coordination_numbers(threads, cn_cells, rcov, K1, keep, virial)
        cn = view.global_sum(cn_share).requires_grad_(True)
        with torch.enable_grad():  # only for dw/dCN, per atom
            c6_of = _C6(numbers, cn, self.c6ref, self.ref_cn, self.n_ref)
        pair_cells = lattice_cells(positions, cell, view.pbc, self.disp2_cutoff)
        tables = self._kernel_tables(c6_of, f64)
        terms = [
            lattice_two_body(threads, pair_cells, c6_of.sidx, c6_of.w.detach(), c6_of.v.detach(), tables, self.damping == "zero", virial)
        ]
        if self.s9 != 0.0:
            terms.append(self._lattice_atm(threads, positions, cell, view.pbc, c6_of, virial))
        (cn_grad,) = torch.autograd.grad(c6_of.w, cn, self._weight_gradient(c6_of, sum(t["u"] for t in terms)))
        cn_grad = view.global_sum(cn_grad)
        chain_forces, chain_virial = lattice_cn_chain(threads, cn_cells, rcov, K1, cn_grad, virial, kept)
        forces = chain_forces + sum(t["forces"] for t in terms)
        total = view.global_sum(torch.cat([forces, sum(t["energies"] for t in terms)[:, None]], dim=1))[owned]
        return total[:, 3], total[:, :3], None if not virial else -(chain_virial + sum(t["vir"] for t in terms))

    def _lattice_atm(self, threads, positions, cell, pbc, c6_of: _C6, virial: bool) -> dict:
        """The ATM term by lattice sums (:func:`~halopipe.kernels.dftd3.lattice_atm`): neighbour images listed, then triples."""
        neighbours = lattice_neighbours(threads, lattice_cells(positions, cell, pbc, self.atm_cutoff))
        r0 = (RS9 * self.r0ab[c6_of.species][:, c6_of.species]).to(positions.dtype).reshape(-1)
        # C9 = s9 sqrt(C6 C6 C6) is defined in atomic units: with C6 in eV Å^6 one sqrt(Hartree) is divided out.
        scale = self.s9 / math.sqrt(units.Hartree)
        return lattice_atm(threads, neighbours, c6_of.sidx, c6_of.w.detach(), c6_of.v.detach(), r0, scale, self.atm_cutoff, virial)

    @staticmethod
    def _weight_gradient(c6_of: _C6, u: torch.Tensor) -> torch.Tensor:
        """``dE/dw_i = sum_s C6ref(Z_i, s) u[i, s]`` (N, n_ref), one contraction per species present."""
        grad = torch.zeros_like(c6_of.w.detach())
        for s in range(c6_of.species.numel()):  # a loop over species present, not atoms
            rows = (c6_of.sidx == s).nonzero().squeeze(1)
            grad[rows] = torch.einsum("rtc,tbc->rb", u[rows], c6_of.table[s])
        return grad

    def _energies(self, view: LocalView) -> torch.Tensor:
        self._check_numbers(view.numbers)
        dtype = view.positions.dtype
        cn = coordination_numbers(view, self.rcov.to(dtype), self.cn_cutoff)
        c6_of = _C6(view.numbers, cn, self.c6ref, self.ref_cn, self.n_ref)
        energies = torch.zeros(view.n_owned, dtype=dtype, device=view.positions.device)
        energies = self._two_body(view, c6_of, energies)
        if self.s9 != 0.0:
            energies = self._three_body(view, c6_of, energies)
        return energies
