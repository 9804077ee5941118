"""Functions run on spawned ranks by the distributed FFT tests (importable by child processes)."""

from __future__ import annotations

import math

import torch

from halopipe.distributed import Comm
from halopipe.distributed.fft import PencilMeshTransform, SlabMeshTransform
from halopipe.models.base import ModelOutput
from halopipe.models.pme import PME

BATCH = 2  # meshes per transform: a batch travels in one message per peer


def _full(sizes, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sizes, generator=g, dtype=torch.float64)


def _box(rank: int, sizes) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """A deterministic box per rank: negative or positive origin, partial or full extents."""
    g = torch.Generator().manual_seed(100 + rank)
    lo = tuple(int(v) for v in torch.randint(-7, 7, (3,), generator=g))
    extent = tuple(int(min(n, v)) for n, v in zip(sizes, torch.randint(1, 9, (3,), generator=g)))
    if rank % 3 == 2:  # one box spans a whole axis
        lo, extent = (0,) + lo[1:], (sizes[0],) + extent[1:]
    return lo, extent, torch.randn((BATCH,) + extent, generator=g, dtype=torch.float64)


def _reference_loss(full: torch.Tensor, weight: torch.Tensor, kernel: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """A nonlinear functional of the transform and its inverse, on each full mesh of the batch with torch.fft."""
    spec = torch.fft.rfftn(full, dim=(-3, -2, -1))
    back = torch.fft.irfftn(spec * kernel, s=full.shape[-3:], dim=(-3, -2, -1), norm="forward")
    return (weight * spec.abs() ** 2).sum() + (probe * back**2).sum()


def _transform(comm: Comm, sizes, grid) -> PencilMeshTransform:
    return SlabMeshTransform(comm, sizes) if grid is None else PencilMeshTransform(comm, sizes, grid)


def fft_case(sizes, grid=None) -> dict:
    """Errors of the transform of a batch of meshes on ``grid`` (slab when None) against torch.fft on the full meshes; its traffic."""
    comm = Comm()
    t = _transform(comm, sizes, grid)
    full = _full((BATCH,) + tuple(sizes), 1)
    h = sizes[2] // 2 + 1
    weight, kernel, probe = _full((sizes[0], sizes[1], h), 2), _full((sizes[0], sizes[1], h), 3), _full(sizes, 4)
    k = (Ellipsis, slice(None), slice(*t.own_rows), slice(*t.own_k2))  # this rank's k-points
    x = (Ellipsis, slice(*t.own_planes), slice(*t.own_columns), slice(None))  # this rank's real-space block

    block = t.scatter_full(full).clone().requires_grad_(True)
    before = (comm.all_to_all_bytes, comm.messages_sent)
    spec = t.forward(block)
    forward_traffic = (comm.all_to_all_bytes - before[0], comm.messages_sent - before[1])
    back_plain = t.inverse(spec)
    back = t.inverse(spec * kernel[k])
    share = (weight[k] * spec.abs() ** 2).sum() + (probe[x] * back**2).sum()
    (grad,) = torch.autograd.grad(share, block)
    total = comm.all_reduce(share.detach())

    ref_full = full.clone().requires_grad_(True)
    ref_loss = _reference_loss(ref_full, weight, kernel, probe)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_full)
    ref_spec = torch.fft.rfftn(full, dim=(-3, -2, -1))
    scale, points = float(ref_spec.abs().max()), math.prod(sizes)
    return {
        "grid": t.grid,
        "shape": tuple(spec.shape),
        "points": block[0].numel(),
        "spectrum": float((spec.detach() - ref_spec[k]).abs().max()) / scale if spec.numel() else 0.0,
        "roundtrip": float((back_plain.detach() - full[x] * points).abs().max()) / points if back_plain.numel() else 0.0,
        "loss_rel": abs(float(total) - float(ref_loss)) / abs(float(ref_loss)),
        "grad_rel": float((grad - ref_grad[x]).abs().max()) / float(ref_grad.abs().max()) if grad.numel() else 0.0,
        "forward_bytes": forward_traffic[0],
        "forward_messages": forward_traffic[1],
    }


def box_case(sizes, grid=None) -> dict:
    """Errors of the box <-> block maps against a full-mesh periodic sum; gradients via autograd."""
    comm = Comm()
    t = _transform(comm, sizes, grid)
    boxes = [_box(r, sizes) for r in range(comm.size)]
    lo, extent, values = boxes[comm.rank]
    weight = _full(sizes, 5)

    box = values.clone().requires_grad_(True)
    boxmap = t.boxes(lo, extent)
    # The map's box holds the requested one (padded); place the values in it and read the requested points back.
    inner = tuple((torch.arange(extent[k]) + (lo[k] - boxmap.lo[k]) % sizes[k]) % boxmap.extent[k] for k in range(3))
    inner = (torch.arange(BATCH)[:, None, None, None], inner[0][:, None, None], inner[1][None, :, None], inner[2][None, None, :])
    padded = torch.zeros((BATCH,) + boxmap.extent, dtype=box.dtype)
    padded = padded.index_put(inner, box) if box.numel() else padded
    block = boxmap.to_mesh(padded)
    read = boxmap.from_mesh(block * t.scatter_full(weight))  # collective: every rank calls it
    read = read[inner] if box.numel() else box
    share = (read**2).sum()
    (grad,) = torch.autograd.grad(share, box)
    total = comm.all_reduce(share.detach())

    # Reference: every box added into the full periodic mesh, then read back, on one process.
    leaves = [v.clone().requires_grad_(True) for _, _, v in boxes]
    full = torch.zeros((BATCH,) + tuple(sizes), dtype=torch.float64)
    for (blo, bext, _), leaf in zip(boxes, leaves):
        idx = [(blo[k] + torch.arange(bext[k])) % sizes[k] for k in range(3)]
        points = (torch.arange(BATCH)[:, None, None, None], idx[0][:, None, None], idx[1][None, :, None], idx[2][None, None, :])
        full = full.index_put(points, leaf, accumulate=True)
    ref_total = 0.0
    for blo, bext, _ in boxes:
        idx = [(blo[k] + torch.arange(bext[k])) % sizes[k] for k in range(3)]
        ref_total = ref_total + ((full * weight)[:, idx[0][:, None, None], idx[1][None, :, None], idx[2][None, None, :]] ** 2).sum()
    ref_grad = torch.autograd.grad(ref_total, leaves)[comm.rank]
    shifted = tuple(v + 1 for v in lo)  # the atoms moved by a mesh point: the padded map still holds every box
    return {
        "reused": t.boxes(lo, extent) is boxmap and t.boxes(shifted, extent) is boxmap,
        "block": float((block.detach() - t.scatter_full(full.detach())).abs().max()) if block.numel() else 0.0,
        "loss_rel": abs(float(total) - float(ref_total)) / abs(float(ref_total)),
        "grad_rel": float((grad - ref_grad).abs().max()) / float(ref_grad.abs().max()),
    }


def run_fft_cases(cases: list) -> list:
    """``cases``: ``(sizes, grid)`` pairs (grid None: the slab transform)."""
    return [fft_case(sizes, grid) for sizes, grid in cases] + [box_case(sizes, grid) for sizes, grid in cases]


def pencil_failure(grid) -> tuple[str, float]:
    """Rank 3 fails while the others wait in the row and column transposes: the seconds until each rank raised."""
    import time

    from halopipe.distributed import DistributedError

    comm = Comm(timeout=60)
    t = PencilMeshTransform(comm, (6, 5, 4), grid)
    block = t.scatter_full(_full((6, 5, 4), 1))
    t.forward(block)  # the row and column groups exist from here on
    start = time.monotonic()
    try:
        with comm.guard("a pencil transform"):
            if comm.rank == 3:
                raise ValueError("pencil rank failed on purpose")
            t.inverse(t.forward(block))
        message = "no error"
    except DistributedError as exc:
        message = str(exc)
    return message, time.monotonic() - start


# ----------------------------------------------------------------- PME on slabs and pencils
def _pme_pipelines(mode: str, sizes, config) -> dict:
    from halopipe import ChargeModel, Group, Pipeline, Step
    from halopipe.models.pme import PME

    def pme():
        return PME(cutoff=6.0, accuracy=1e-6, mesh_size=sizes, order=4, mesh=mode)

    return {
        "fixed_charges": Pipeline([Group([Step(pme())], autograd=True)], config=config),
        # Direct forces (no autograd graph; the virial by a local strain derivative, collectively).
        "direct": Pipeline([Group([Step(pme())], autograd=False)], config=config),
        # Charges that depend on positions: forces then include dE/dq * dq/dr, so they test dE/dq.
        "charge_model": Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(pme())], autograd=True)], config=config),
    }


def pme_case(grid, sizes, mesh: str = "distributed") -> dict | None:
    """Distributed-mesh PME (``mesh``: distributed, slab or pencil) under domain decomposition vs the replicated mesh on one process."""
    from halopipe.distributed import DomainConfig, ShardedSystem

    from ._workers import make_system, rank

    system = make_system("triclinic")
    config = DomainConfig(grid=grid, timeout=60)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    gathered = {}
    for name, pipeline in _pme_pipelines(mesh, sizes, config).items():
        out = pipeline(sharded, stress=True)
        gathered[name] = (out, sharded.gather(out["forces"]))
    process_grid = sharded.mesh_transform(sizes, mesh if mesh in ("slab", "pencil") else "auto").grid  # cached: the one used
    if rank() != 0:
        return None
    result = {"process_grid": process_grid}
    for name, pipeline in _pme_pipelines("replicated", sizes, config).items():
        out, forces = gathered[name]
        ref = pipeline(system, stress=True, decompose=False)
        result[name] = {
            "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
            "force": float((forces - ref["forces"]).abs().max()),
            "stress": float((out["stress"] - ref["stress"]).abs().max()),
        }
    return result


def run_pme_cases(cases: list) -> list:
    return [pme_case(**case) for case in cases]


class _WeightedPME(PME):
    """PME whose shares are weighted by a fixed factor per atom (from its global index): non-uniform cotangents.

    A ghost row's share (per-row energies, :class:`~halopipe.models.ModelOutput`) is its owner's, so it takes the
    owner's weight: a ghost row carries its owner's id.
    """

    def forward(self, view, direct=False):
        energies = super().forward(view).energies
        weights = 1.0 + 0.25 * (view.ids[: energies.shape[0]] % 3).to(view.positions.dtype)
        return ModelOutput(energies=weights * energies)


def weighted_pme_case(grid, sizes, mesh: str) -> dict | None:
    """Weighted PME shares (the exact-adjoint backward) under domain decomposition vs one process, with a ChargeModel."""
    from halopipe import ChargeModel, Group, Pipeline, Step
    from halopipe.distributed import DomainConfig, ShardedSystem

    from ._workers import make_system, rank

    system = make_system("triclinic")
    config = DomainConfig(grid=grid, timeout=60)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)

    def pipeline(mode: str):
        pme = _WeightedPME(6.0, 1e-6, mesh_size=sizes, order=4, mesh=mode)
        return Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(pme)], autograd=True)], config=config)

    out = pipeline(mesh)(sharded, stress=True)
    forces = sharded.gather(out["forces"])
    if rank() != 0:
        return None
    ref = pipeline("replicated")(system, stress=True, decompose=False)
    return {
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "force": float((forces - ref["forces"]).abs().max()),
        "stress": float((out["stress"] - ref["stress"]).abs().max()),
    }


def run_weighted_pme_cases(cases: list) -> list:
    return [weighted_pme_case(**case) for case in cases]


# ------------------------------------------------------------------ gathers
def gather_case() -> dict:
    """Gathers to rank 0 and to every rank against the scattered system; bytes each rank sends."""
    from halopipe.distributed import DomainConfig, ShardedSystem

    from ._workers import make_system, rank

    system = make_system("triclinic")
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, DomainConfig(timeout=60))
    sent0 = sharded.comm.bytes_sent
    to_root = sharded.gather(sharded.positions, root=0)
    sent = sharded.comm.bytes_sent - sent0
    everywhere = sharded.gather(sharded.fields["charges"])
    whole = sharded.to_system(root=0)
    out = {
        "root_is_none": to_root is None and whole is None,
        "everywhere": float((everywhere - system.fields["charges"]).abs().max()),
        "sent": sent,
        "owned": sharded.n_owned,
    }
    if rank() == 0:
        out["root"] = float((to_root - system.positions).abs().max())
        out["numbers_equal"] = bool((whole.numbers == system.numbers).all())
        out["masses"] = float((whole.masses - system.masses).abs().max())
    return out


# ------------------------------------------------------------ sub-communicators
def split_case() -> dict:
    """On 4 ranks: the parts [0, 2] and [1, 3] reduce, exchange, broadcast and gather among themselves only."""
    comm = Comm()
    part = comm.split([[0, 2], [1, 3]])
    me = torch.tensor([float(comm.rank)])
    peer = 1 - part.rank
    got = part.exchange({peer: me * 10}, {peer: (1,)}, me.dtype, me.device)[peer]
    sent_before = comm.bytes_sent
    total = part.all_reduce(me)
    rows = part.gather_rows(torch.full((comm.rank + 1, 2), float(comm.rank)), root=1)
    return {
        "sub_rank": part.rank,
        "sum": float(total[0]),
        "from_peer": float(got[0]),
        "broadcast": float(part.broadcast(me if part.rank == 1 else None, (1,), me.dtype, me.device, src=1)[0]),
        "gathered": None if rows is None else rows[:, 0].tolist(),
        "parent_counted": comm.bytes_sent - sent_before,
        "again_cached": comm.split([[0, 2], [1, 3]]).group is part.group,
    }
