"""DFT-D3 by lattice sums: every periodic image summed inside the kernels, none a row (see :mod:`._warp_d3`).

All atoms are wrapped into the cell and binned (:func:`lattice_cells`);
one thread per owned atom walks the partners and their images within a
cutoff. The walks give this rank's share of the coordination numbers
(:func:`lattice_coordination_numbers`), of the two-body energy, forces and
``dE/dC6`` times the partners' weights (:func:`lattice_two_body`), of the
CN chain forces once ``dE/dCN`` is known (:func:`lattice_cn_chain`), and,
over each atom's listed neighbour images (:func:`lattice_neighbours`), of
the ATM three-body term (:func:`lattice_atm`). Each pair and triple is taken
by one thread and lands on all its atoms, so the shares summed over ranks
are the whole: the model (:mod:`halopipe.models.dftd3`) adds them with its
view's global sums. Only Warp kernels exist; without Warp the model works
on ghost rows in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..geometry import Geometry
from ..scratch import ScratchPool
from .backend import warp_module
from .pairs import launch, warp_kernel

__all__ = [
    "D3Tables",
    "LatticeCells",
    "keeps_chain_terms",
    "keeps_sparse_chain_terms",
    "lattice_atm",
    "lattice_cells",
    "lattice_cn_chain",
    "lattice_coordination_numbers",
    "lattice_kernel_available",
    "lattice_neighbours",
    "lattice_two_body",
    "sparse_chain_capacity",
]


@dataclass(frozen=True)
class D3Tables:
    """Per species pair (flattened ``s_a * S + s_b``): ``C8/C6`` and the damping's ``r0_6``, ``r0_8``; and scalars."""

    c8_over_c6: torch.Tensor
    r0_6: torch.Tensor
    r0_8: torch.Tensor
    n_species: int
    s6: float
    s8: float


# ------------------------------------------------------------------------------ lattice sums
@dataclass(frozen=True)
class LatticeCells:
    """Every atom of a system wrapped into its cell and binned, for lattice sums within one cutoff.

    ``positions``/``frac``: wrapped Cartesian and binning (working-basis
    fractional) coordinates; ``lattice``: the three cell rows as tuples;
    ``half_width``: the cutoff sphere's reach in fractional coordinates per
    axis (its bounding box); bins of about cutoff / 3 per axis (whole cell periods on periodic axes, the atoms' extent on open ones),
    ``bin_start`` / ``bin_atoms`` in CSR form.
    """

    positions: torch.Tensor
    frac: torch.Tensor
    lattice: tuple
    periodic: tuple
    origin: tuple
    span: tuple
    half_width: tuple
    nb: tuple
    bin_start: torch.Tensor
    bin_atoms: torch.Tensor
    cutoff: float

    def kernel_inputs(self) -> list:
        wp = warp_module()
        vec = lambda x: wp.vec3d(*x)  # noqa: E731
        return [
            self.positions,
            self.frac,
            *(vec(row) for row in self.lattice),
            wp.vec3i(*self.periodic),
            vec(self.origin),
            vec(self.span),
            vec(self.half_width),
            wp.vec3i(*self.nb),
            self.bin_start,
            self.bin_atoms,
            self.cutoff**2,
        ]


BINS_PER_CUTOFF = 3  # bins of cutoff / 3: a thread scans about (2 + 1/3)^3 cutoff^3 of candidates
ATOMS_PER_BIN = 4  # but no smaller than this many atoms on average: an empty bin costs a visit too
MAX_BINS_PER_AXIS = 64


def lattice_cells(positions: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor, cutoff: float) -> LatticeCells:
    """Wrap ``positions`` (all atoms, float64) into ``cell`` on its periodic axes and bin them for ``cutoff``."""
    geometry = Geometry(cell, pbc)
    basis, inverse = geometry.basis.to(positions), geometry.inverse.to(positions)
    periodic = [bool(p) for p in geometry.pbc.tolist()]
    frac = positions @ inverse
    mask = torch.tensor(periodic, device=positions.device)
    wrap = torch.where(mask, torch.floor(frac), torch.zeros_like(frac))
    frac = frac - wrap
    wrapped = positions - wrap @ basis
    origin, span = [], []
    heights = geometry.heights.tolist()
    for a in range(3):
        if periodic[a] or frac.shape[0] == 0:
            lo, width = 0.0, 1.0
        else:
            lo = float(frac[:, a].min())
            width = max(float(frac[:, a].max()) - lo, 1e-9)
        origin.append(lo)
        span.append(width)
    widths = [w * h for w, h in zip(span, heights)]  # Å across the binned region, per axis
    volume = max(float(torch.linalg.det(geometry.basis).abs()) * math.prod(span), 1e-30)
    bin_length = max(cutoff / BINS_PER_CUTOFF, (ATOMS_PER_BIN * volume / max(frac.shape[0], 1)) ** (1.0 / 3.0))
    nb = [int(min(max(w // bin_length, 1), MAX_BINS_PER_AXIS)) for w in widths]
    scale = torch.tensor([n / w for n, w in zip(nb, span)], dtype=frac.dtype, device=frac.device)
    index = torch.floor((frac - torch.tensor(origin, dtype=frac.dtype, device=frac.device)) * scale).to(torch.int64)
    index = torch.minimum(index.clamp_min(0), torch.tensor(nb, device=frac.device) - 1)  # rounding at the far face
    linear = (index[:, 0] * nb[1] + index[:, 1]) * nb[2] + index[:, 2]
    order = torch.argsort(linear, stable=True)
    start = torch.zeros(nb[0] * nb[1] * nb[2] + 1, dtype=torch.int64, device=frac.device)
    start[1:] = torch.cumsum(torch.bincount(linear, minlength=start.numel() - 1), 0)
    lattice = cell.detach().to(torch.float64).cpu()
    half_width = [(cutoff / h) * (1.0 + 1e-12) + 1e-12 for h in heights]  # fractional reach of the sphere per axis
    return LatticeCells(
        positions=wrapped.contiguous(),
        frac=frac.contiguous(),
        lattice=tuple(tuple(row) for row in lattice.tolist()),
        periodic=tuple(int(p) for p in periodic),
        origin=tuple(origin),
        span=tuple(span),
        half_width=tuple(half_width),
        nb=tuple(nb),
        bin_start=start.to(torch.int32),
        bin_atoms=order.to(torch.int32),
        cutoff=float(cutoff),
    )


def lattice_kernel_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float64 and warp_kernel("lattice_bj", "_warp_d3") is not None


def _lattice_launch(name: str, owned: torch.Tensor, cells: LatticeCells, species: torch.Tensor, inputs: dict, virial: bool) -> dict:
    """Launch one lattice-sum kernel over the ``owned`` atoms; returns its outputs (``vir`` summed, or None)."""
    wp = warp_module()
    n, dtype, device = cells.positions.shape[0], cells.positions.dtype, cells.positions.device
    want = inputs["want"]
    empty = torch.zeros(0, dtype=dtype, device=device)
    rows = lambda key: n if key in want else 0  # noqa: E731
    ref_weights = inputs.get("ref_weights", torch.zeros(0, 1, dtype=dtype, device=device))
    v = inputs.get("v", torch.zeros(0, 1, 1, dtype=dtype, device=device))
    kept = (owned.numel(), inputs.get("capacity", n)) if "pairs" in want else (0, 0)  # a (thread, partner or slot) table
    outputs = {
        "cn": torch.zeros(rows("cn"), dtype=dtype, device=device),
        "energies": torch.zeros(rows("energies"), dtype=dtype, device=device),
        "forces": torch.zeros(rows("forces"), 3, dtype=dtype, device=device),
        "u": torch.zeros_like(v) if "u" in want else torch.zeros(0, 1, 1, dtype=dtype, device=device),
        "vir": torch.zeros(owned.numel() if virial else 0, 3, 3, dtype=dtype, device=device),
        # a dense table is summed whole, so it starts at zero; sparse slots (given) are read up to each thread's count
        "pair_grad": inputs["pair_grad"] if "pair_grad" in inputs else torch.zeros(*kept, 3, dtype=dtype, device=device),
        "pair_outer": torch.zeros(*(kept if virial else (0, 0)), 3, 3, dtype=dtype, device=device),
    }
    args = [owned, *cells.kernel_inputs(), species]
    args += [inputs.get("rcov", empty), float(inputs.get("k1", 0.0)), inputs.get("cn_grad", empty)]
    args += [wp.from_torch(ref_weights.contiguous()), wp.from_torch(v.contiguous())]
    args += [inputs.get(key, empty) for key in ("c8_over_c6", "q6", "q8")]
    args += [int(inputs.get("n_species", 1)), float(inputs.get("s6", 0.0)), float(inputs.get("s8", 0.0))]
    outs = [outputs["cn"], outputs["energies"], outputs["forces"], wp.from_torch(outputs["u"])]
    outs += [wp.from_torch(outputs["vir"], dtype=wp.mat33d)]
    outs += [wp.from_torch(outputs["pair_grad"], dtype=wp.vec3d), wp.from_torch(outputs["pair_outer"], dtype=wp.mat33d)]
    no_list = torch.zeros(0, dtype=torch.int32, device=device)
    lists = inputs.get("neighbours", {})
    outs += [lists.get("start", no_list), lists.get("count", no_list), lists.get("atom", no_list)]
    outs += [wp.from_torch(lists.get("shift", torch.zeros(0, 3, dtype=torch.int32, device=device)), dtype=wp.vec3i)]
    outs += [wp.from_torch(lists.get("vec", torch.zeros(0, 3, dtype=dtype, device=device)), dtype=wp.vec3d)]
    if owned.numel():
        launch(warp_kernel(name, "_warp_d3"), owned.numel(), device, args, outs)
    outputs["vir"] = outputs["vir"].sum(dim=0) if virial else None
    return outputs


CHAIN_STORE_BYTES = 64 << 20
"""Memory the coordination-number walk may fill with each (thread, partner) pair's chain terms.

Small cells (every atom a partner of every atom, through its images) then
get the chain forces by a dense contraction instead of a second walk. The
choice must not depend on whether the virial is wanted (forces are the same
bits either way), so the budget counts both terms (12 numbers a pair).
"""


def keeps_chain_terms(n_threads: int, n_atoms: int) -> bool:
    """Whether the coordination-number walk stores its chain terms (a (threads, atoms) table) within :data:`CHAIN_STORE_BYTES`."""
    return n_threads * n_atoms * 12 * 8 <= CHAIN_STORE_BYTES


def sparse_chain_capacity(n_atoms: int, volume: float, cutoff: float) -> int:
    """Partner slots per thread for :func:`lattice_coordination_numbers`' sparse store: 1.5x a thread's expected share.

    A thread takes about half the partners within ``cutoff`` of its atom (each
    pair once), ``n_atoms / volume x 4/3 pi cutoff^3 / 2`` at uniform density;
    a denser spot overflows the slots, and the chain forces then walk again.
    """
    expected = n_atoms / max(volume, 1e-30) * (4.0 / 3.0) * math.pi * cutoff**3 / 2.0
    return int(min(1.5 * expected + 64, n_atoms))


SPARSE_CHAIN_STORE_BYTES = 1536 << 20
"""Memory the coordination-number walk may fill with its partners' chain terms in slots (:func:`keeps_sparse_chain_terms`).

About 28 bytes x 1,000 partners per owned atom of a solid at the 40 bohr CN
cutoff: 1.5 GiB holds 32,768 Si atoms on one process (each rank holds its
owned atoms' share). Beyond it the chain walks a second time, which nearly
doubles the coordination-number cost (Si 13,824 on one process: 2.16 s at a
256 MiB budget, docs/benchmarks.md).
"""


def keeps_sparse_chain_terms(n_threads: int, capacity: int) -> bool:
    """Whether ``capacity`` partner slots per thread (the partner and its ``sum_t h d``, 28 bytes) fit :data:`SPARSE_CHAIN_STORE_BYTES`.

    The slots never hold the virial terms (the chain's virial walks again), so
    that the choice, and with it the forces' last bits, does not depend on
    whether the stress is wanted.
    """
    return n_threads * capacity * (4 + 24) <= SPARSE_CHAIN_STORE_BYTES


def lattice_coordination_numbers(
    owned: torch.Tensor,
    cells: LatticeCells,
    rcov: torch.Tensor,
    k1: float,
    keep: bool = False,
    virial: bool = False,
    capacity: int | None = None,
    pool: ScratchPool | None = None,
) -> tuple[torch.Tensor, tuple | None]:
    """This rank's share of every atom's D3 coordination number, (N,): the pairs its ``owned`` threads take.

    Summed over ranks (each pair is taken once), it is the coordination
    number of every atom. ``keep``: also return each (thread, partner) pair's
    chain terms for :func:`lattice_cn_chain`: a dense (threads, atoms) table
    (with their virial part when ``virial``), or with ``capacity`` the threads'
    partners in ``capacity`` slots each, without the virial part
    (:func:`sparse_chain_capacity`; None is returned instead when a thread has
    more partners, and the chain walks again). The slots come from ``pool``
    (give them back after :func:`lattice_cn_chain`).
    """
    species = torch.zeros(cells.positions.shape[0], dtype=torch.int32, device=rcov.device)
    sparse = keep and capacity is not None
    stored_virial = keep and virial and not sparse  # the sparse slots hold no virial terms
    name = "lattice_cn_count" + (("_sparse" if sparse else "_store") if keep else "") + ("_virial" if stored_virial else "")
    inputs = {"rcov": rcov, "k1": k1, "want": ("cn", "pairs") if keep else ("cn",)}
    if sparse:
        n = owned.numel()
        pool = pool or ScratchPool()
        lists = {  # slots past a thread's count are never read: no need to clear them (hundreds of MB on large cells)
            "atom": pool.take((n * capacity,), torch.int32, rcov.device),
            "count": torch.zeros(n, dtype=torch.int32, device=rcov.device),
        }
        inputs.update(capacity=int(capacity), neighbours=lists, pair_grad=pool.take((n, capacity, 3), rcov.dtype, rcov.device))
    out = _lattice_launch(name, owned, cells, species, inputs, stored_virial)
    if not keep:
        return out["cn"], None
    if not sparse:
        return out["cn"], (out["pair_grad"], out["pair_outer"] if virial else None)
    if n and int(lists["count"].max()) > capacity:  # a thread overflowed its slots: the chain walks again
        pool.give(out["pair_grad"], lists["atom"])
        return out["cn"], None
    return out["cn"], (out["pair_grad"], None, lists["atom"], lists["count"])


def lattice_cn_chain(
    owned: torch.Tensor, cells: LatticeCells, rcov: torch.Tensor, k1: float, cn_grad: torch.Tensor, virial: bool, kept: tuple | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forces ``-dE/dr`` (N, 3) through the coordination numbers, from ``cn_grad = dE/dCN`` of every atom, and ``sum d (x) dE/dd``.

    This rank's share: the pairs its ``owned`` threads take (forces land on
    both ends). ``kept``: the chain terms the coordination-number walk stored,
    contracted instead of walking again (the dense table in torch, the sparse
    slots in a Warp kernel over the threads' stored partners; their virial walks).
    """
    if kept is not None and len(kept) == 4:  # the sparse store: thread k's partners atom[k * capacity + slot], slot < count[k]
        grad, _, atom, count = kept
        wp = warp_module()
        forces = torch.zeros_like(cells.positions)
        if owned.numel():
            launch(
                warp_kernel("sparse_cn_chain", "_warp_d3"),
                owned.numel(),
                rcov.device,
                [owned, atom, count, wp.from_torch(grad, dtype=wp.vec3d), cn_grad],
                [forces],
            )
        if not virial:
            return forces, None
        # The slots hold no virial terms: the virial walks again (its forces, the same to rounding, are not used).
        return forces, lattice_cn_chain(owned, cells, rcov, k1, cn_grad, True)[1]
    if kept is not None:
        grad, outer = kept
        coef = cn_grad[owned.long()][:, None] + cn_grad[None, :]  # (a_i + a_j) per (thread, partner)
        pair_force = -coef[..., None] * grad  # on the thread's atom; its partner gets the opposite
        forces = torch.zeros_like(cells.positions).index_add_(0, owned.long(), pair_force.sum(dim=1)) - pair_force.sum(dim=0)
        return forces, -(coef.reshape(1, -1) @ outer.reshape(-1, 9)).reshape(3, 3) if virial else None
    species = torch.zeros(cells.positions.shape[0], dtype=torch.int32, device=rcov.device)
    inputs = {"rcov": rcov, "k1": k1, "cn_grad": cn_grad.contiguous(), "want": ("forces",)}
    name = "lattice_cn_chain_virial" if virial else "lattice_cn_chain"
    out = _lattice_launch(name, owned, cells, species, inputs, virial)
    return out["forces"], out["vir"]


def lattice_two_body(
    owned: torch.Tensor,
    cells: LatticeCells,
    species: torch.Tensor,
    ref_weights: torch.Tensor,
    v: torch.Tensor,
    tables: D3Tables,
    zero_damping: bool,
    virial: bool,
) -> dict:
    """This rank's share of the two-body D3 sum over lattice images: ``energies`` (N,), ``forces`` (N, 3), ``u`` and ``vir``.

    ``v[i, s] = w_i^T C6ref(Z_i, s)`` (N, S, n_ref); ``u[i, s]`` is the sum
    of ``dE/dC6_ij w_j`` over partners ``j`` of species ``s``, so
    ``dE/dw_i = sum_s C6ref(Z_i, s) u[i, s]``. ``tables.r0_6``/``r0_8`` hold
    ``R0^6``/``R0^8`` (BJ) or ``(rs6 R0)^2``/``(rs8 R0)^2`` (zero damping).
    """
    inputs = {
        "ref_weights": ref_weights,
        "v": v,
        "c8_over_c6": tables.c8_over_c6,
        "q6": tables.r0_6,
        "q8": tables.r0_8,
        "n_species": tables.n_species,
        "s6": tables.s6,
        "s8": tables.s8,
        "want": ("energies", "forces", "u"),
    }
    name = ("lattice_zero" if zero_damping else "lattice_bj") + ("_virial" if virial else "")
    return _lattice_launch(name, owned, cells, species.to(torch.int32).contiguous(), inputs, virial)


def lattice_neighbours(owned: torch.Tensor, cells: LatticeCells) -> dict:
    """Every neighbour image ``(j, t)`` within ``cells.cutoff`` of each ``owned`` atom, in CSR form (two walks: count, fill).

    ``start`` (threads + 1,), and per entry ``atom``, ``shift`` (the
    translation ``t``, in cells) and ``vec`` (``r_j + t @ cell - r_i``).
    """
    n, device = owned.numel(), cells.positions.device
    species = torch.zeros(cells.positions.shape[0], dtype=torch.int32, device=device)
    count = torch.zeros(n, dtype=torch.int32, device=device)
    _lattice_launch("lattice_neighbour_count", owned, cells, species, {"want": (), "neighbours": {"count": count}}, False)
    start = torch.zeros(n + 1, dtype=torch.int32, device=device)
    start[1:] = torch.cumsum(count, 0)
    total = int(start[-1])
    lists = {
        "start": start,
        "atom": torch.zeros(total, dtype=torch.int32, device=device),
        "shift": torch.zeros(total, 3, dtype=torch.int32, device=device),
        "vec": torch.zeros(total, 3, dtype=cells.positions.dtype, device=device),
    }
    _lattice_launch("lattice_neighbour_fill", owned, cells, species, {"want": (), "neighbours": lists}, False)
    return lists


def lattice_atm(
    owned: torch.Tensor,
    neighbours: dict,
    species: torch.Tensor,
    ref_weights: torch.Tensor,
    v: torch.Tensor,
    r0: torch.Tensor,
    s9: float,
    cutoff: float,
    virial: bool,
) -> dict:
    """This rank's share of the ATM three-body energy over lattice images: ``energies``, ``forces``, ``u``, ``vir``.

    ``neighbours``: :func:`lattice_neighbours` at ``cutoff``. ``r0``: the
    species-pair damping radii (``RS9 R0AB``, flattened); ``s9``: the ATM
    scale in the energy's units (``s9 / sqrt(Hartree)`` for C6 in eV Å^6).
    ``u`` as in :func:`lattice_two_body`, so the weights' gradient is one contraction for both terms.
    """
    wp = warp_module()
    n, dtype, device = ref_weights.shape[0], ref_weights.dtype, ref_weights.device
    species = species.to(torch.int32).contiguous()
    first = torch.repeat_interleave(owned.long(), torch.diff(neighbours["start"]).long())  # the centre of each entry
    second = neighbours["atom"].long()
    sidx = species.long()
    pair_c6 = (v[first, sidx[second]] * ref_weights[second]).sum(dim=1).contiguous()
    out = {
        "energies": torch.zeros(n, dtype=dtype, device=device),
        "forces": torch.zeros(n, 3, dtype=dtype, device=device),
        "u": torch.zeros_like(v),
        "vir": torch.zeros(owned.numel() if virial else 0, 3, 3, dtype=dtype, device=device),
    }
    pair_grad = torch.zeros_like(pair_c6)
    inputs = [owned, neighbours["start"], neighbours["atom"], neighbours["shift"], neighbours["vec"], pair_c6, 1.0 / pair_c6, species]
    inputs += [
        int(v.shape[1]),
        r0.contiguous(),
        wp.from_torch(ref_weights.contiguous()),
        wp.from_torch(v.contiguous()),
        float(s9),
        cutoff**2,
    ]
    outputs = [out["energies"], out["forces"], wp.from_torch(out["u"]), pair_grad, wp.from_torch(out["vir"], dtype=wp.mat33d)]
    if owned.numel():
        launch(warp_kernel("lattice_atm_virial" if virial else "lattice_atm", "_warp_d3"), owned.numel(), device, inputs, outputs)
    # dE/dC6 of each (centre, neighbour) pair into u, at both ends, as the kernel does for the third pair.
    out["u"].index_put_((first, sidx[second]), pair_grad[:, None] * ref_weights[second], accumulate=True)
    out["u"].index_put_((second, sidx[first]), pair_grad[:, None] * ref_weights[first], accumulate=True)
    out["vir"] = out["vir"].sum(dim=0) if virial else None
    return out
