"""Functions run on spawned ranks by the distributed tests (importable by child processes)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from halopipe import ChargeModel, DSFCoulomb, Group, LennardJones, Model, ModelOutput, Pipeline, Step, System
from halopipe.distributed import DistributedError, DomainConfig, ShardedSystem

LJ = dict(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.6, 17: 3.6})


def affinity() -> list[int]:
    """The cores this rank may run on."""
    return sorted(os.sched_getaffinity(0))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def make_system(kind: str, seed: int = 0) -> System:
    """Deterministic test systems (built identically on every rank)."""
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    if kind in ("triclinic", "mixed"):
        atoms = bulk("NaCl", "rocksalt", a=5.64).repeat((4, 4, 4))  # 128 atoms, primitive (triclinic) cell
        atoms.positions += rng.normal(scale=0.2, size=atoms.positions.shape)
        atoms.set_cell(atoms.cell.array + np.array([[0, 0.4, 0.2], [0.6, 0, 0.1], [0.1, 0.7, 0]]), scale_atoms=True)
        if kind == "mixed":
            atoms.pbc = (True, False, True)
    elif kind == "small_box":  # cell heights well below the longest cutoff
        atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((2, 1, 1))
        atoms.positions += rng.normal(scale=0.2, size=atoms.positions.shape)
    else:
        raise ValueError(kind)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def make_pipeline(kind: str = "all", skin: float = 0.0, config: DomainConfig | None = None) -> Pipeline:
    config = config or DomainConfig(skin=skin)
    if kind == "all":  # a direct group, an autograd group, and a wired autograd group
        return Pipeline(
            [
                Group([Step(LennardJones(**LJ, cutoff=4.5))], autograd=False),
                Group([Step(LennardJones(0.002, 3.0, cutoff=6.5), name="LJ_autograd")], autograd=True),
                Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(DSFCoulomb(9.0, 0.2))], autograd=True),
            ],
            config=config,
        )
    if kind == "halo_economy":
        return Pipeline([Group([Step(LennardJones(**LJ, cutoff=3.0))], autograd=False), Group([Step(DSFCoulomb(9.0, 0.2))])], config=config)
    raise ValueError(kind)


def compare_case(system_kind: str, grid, skin: float = 0.0, halo: str = "per_model", pipeline_kind: str = "all") -> dict | None:
    """Evaluate distributed and (on rank 0) single-process; return differences on rank 0."""
    system = make_system(system_kind)
    config = DomainConfig(grid=grid, skin=skin, halo=halo, timeout=60)
    pipeline = make_pipeline(pipeline_kind, config=config)
    stress = bool(system.pbc.all())
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    out = pipeline(sharded, stress=stress)
    forces = sharded.gather(out["forces"])
    energies = sharded.gather(out["energies"])  # ghost rows' shares folded home on the ranks that own them
    forces_only = sharded.gather(pipeline(sharded, energy=False)["forces"])  # an MD step between reports
    charges = sharded.gather(out["fields"]["charges"])
    ids = sharded.gather(torch.ones(sharded.n_owned, dtype=torch.int64))
    if rank() != 0:
        return None
    ref = pipeline(system, stress=stress, decompose=False)
    result = {
        "grid": sharded.grid,
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "energies_rel": max(
            abs(float(out["model_energies"][k] - ref["model_energies"][k])) / max(abs(float(ref["model_energies"][k])), 1e-300)
            for k in ref["model_energies"]
        ),
        "atom_energies": float((energies - ref["energies"]).abs().max()),
        "force": float((forces - ref["forces"]).abs().max()),
        "forces_only_equal": bool(torch.equal(forces_only, forces)),
        "charges": float((charges - ref["fields"]["charges"]).abs().max()),
        "owned_once": bool((ids == 1).all()),
        "halo": out["halo"],
    }
    if stress:
        result["stress_rel"] = float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max())
    return result


def run_cases(cases: list[dict]) -> list:
    return [compare_case(**case) for case in cases]


def _walk_step(g: torch.Generator, n: int) -> torch.Tensor:
    """A collective drift (so atoms cross bricks) plus small independent noise (so nothing overlaps)."""
    drift = 0.15 * torch.randn(1, 3, generator=g, dtype=torch.float64)
    return drift + 0.015 * torch.randn(n, 3, generator=g, dtype=torch.float64)


def migration_walk(steps: int, grid, skin: float) -> dict | None:
    """Random displacements keyed by atom id; plans rebuilt and atoms migrated; compare at the end."""
    system = make_system("triclinic", seed=3)
    # per-atom data of every kind rides along with its atom: an integer field and a vector field, keyed by id
    atom = torch.arange(system.n_atoms)
    system.fields["tag"] = (atom * 7 % 5).to(torch.int32)
    system.fields["vector"] = torch.stack([atom, -atom, 2 * atom], dim=1).to(system.dtype) / 3.0
    config = DomainConfig(grid=grid, skin=skin, timeout=60)
    pipeline = make_pipeline("all", config=config)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    width = pipeline.halo
    owners_changed, replans, plans_equal = 0, 0, True
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        kick = _walk_step(g, system.n_atoms)
        before = sharded.ids.clone()
        rebuilds = sharded.rebuilds
        sharded.positions = sharded.positions + kick[sharded.ids]
        sharded.prepare(width)
        owners_changed += int(before.numel() != sharded.ids.numel() or not torch.equal(before, sharded.ids))
        if sharded.rebuilds != rebuilds:  # alike on every rank, so the check's collective plan runs everywhere
            plans_equal &= _plan_as_placed_afresh(sharded)
            replans += 1
    out = pipeline(sharded, stress=True)
    ids = sharded.gather(torch.ones(sharded.n_owned, dtype=torch.int64))
    forces = sharded.gather(out["forces"])
    final = sharded.to_system()
    changed = sharded.all_reduce(torch.tensor([owners_changed]))
    if rank() != 0:
        return None
    # Independent replay of the same walk on one process.
    pos = system.positions.clone()
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        pos = pos + _walk_step(g, system.n_atoms)
    ref = pipeline(system.replace(positions=pos), stress=True, decompose=False)
    carried = [torch.equal(final.numbers, system.numbers), torch.equal(final.masses, system.masses)]
    carried += [final.fields[k].dtype == v.dtype and torch.equal(final.fields[k], v) for k, v in system.fields.items()]
    return {
        "ids_once": bool((ids == 1).all()),
        "carried": carried,
        "positions": float((final.positions - pos).abs().max()),
        "force": float((forces - ref["forces"]).abs().max()),
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "rebuilds": sharded.rebuilds - replans,
        "owner_changes": int(changed),
        "plans_equal": bool(plans_equal),
    }


def _plan_as_placed_afresh(sharded: ShardedSystem) -> bool:
    """Whether the plan a rebuild made (from the owned rows' placement carried through the migration) is the one
    placing every owned row again gives: the same ghost rows (ids, shifts, bands, bit for bit) and sends."""
    made = (sharded.ghost_ids, sharded.ghost_shift, sharded.ghost_band, sharded.owned_shift, sharded.plan.send_atom)
    sharded._build_plan(sharded.halo_bands, sharded._peers, sharded._place())
    again = (sharded.ghost_ids, sharded.ghost_shift, sharded.ghost_band, sharded.owned_shift, sharded.plan.send_atom)
    return all(torch.equal(a, b) for a, b in zip(made, again))


def comm_volume(grid) -> dict:
    """Bytes one refresh sends vs the ghost rows this rank serves to others."""
    system = make_system("triclinic")
    out = {}
    for halo in ("per_model", "max"):
        config = DomainConfig(grid=grid, skin=0.0, halo=halo, timeout=60)
        pipeline = make_pipeline("halo_economy", config=config)
        sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
        res = pipeline(sharded)
        out[halo] = res["halo"]
        comm = sharded.comm
        x = torch.randn(sharded.n_owned, dtype=torch.float64)
        before = comm.bytes_sent
        sharded.ghost_rows(x, pipeline.halo)
        sent = comm.bytes_sent - before
        served = sum(c for d, c in sharded.plan.send_counts.items() if d != comm.rank)
        out[halo + "_ratio"] = sent / max(served * 8, 1)
        out[halo + "_served"] = served
        sharded.prepare([3.0, pipeline.halo])  # the short-range model's own width as a band of its own (so already with per_model)
        x = torch.randn(sharded.n_owned, dtype=torch.float64)
        before = comm.bytes_sent
        sharded.ghost_rows(x, 3.0)
        out[halo + "_short_bytes"] = comm.bytes_sent - before
        out[halo + "_wide_bytes"] = sent
        out["n_total"] = system.n_atoms
    return out


def _counted(calls: dict, name: str, call):
    """``call`` that adds one to ``calls[name]`` each time it runs."""

    def counted(*args, **kwargs):
        calls[name] += 1
        return call(*args, **kwargs)

    return counted


def autograd_collectives(model: str) -> dict:
    """Collectives of one evaluation of an autograd pair model on an unchanged plan, forces only and with energies.

    ``model``: ``"lj"`` or ``"dsf"`` (static charges). Counted by spying on the
    communicator: exchanges (point to point) and reductions.
    """
    system = make_system("triclinic")
    config = DomainConfig(grid=(2, 1, 1), skin=0.5, timeout=60)
    pair = LennardJones(0.002, 3.0, cutoff=6.5) if model == "lj" else DSFCoulomb(9.0, 0.2)
    pipeline = Pipeline([Group([Step(pair)], autograd=True)], config=config)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    pipeline(sharded)  # builds the plan and the lists
    comm, calls = sharded.comm, {"exchange": 0, "all_reduce": 0}
    for name in calls:
        setattr(comm, name, _counted(calls, name, getattr(comm, name)))
    counts = {}
    for label, energy in (("forces", False), ("energy", True)):
        before = dict(calls)
        pipeline(sharded, energy=energy)
        counts[label] = {name: calls[name] - before[name] for name in calls}
    return {"counts": counts, "rebuilds": sharded.rebuilds}


class FailOnRank(Model):
    """Raises on one rank only, in the middle of an evaluation (after others started communicating)."""

    cutoff = 3.0

    def __init__(self, bad_rank: int):
        super().__init__()
        self.bad_rank = bad_rank

    def forward(self, view, direct=False):
        if rank() == self.bad_rank:
            raise ValueError("model exploded on purpose")
        q = view.refresh(view.positions[: view.n_owned, 0])
        return ModelOutput(energies=q[: view.n_owned] * 0.0 + view.global_sum(q.sum()) * 0.0)


def failure(kind: str) -> str:
    """Run a failing scenario; return the error message this rank ended with (and the time it took)."""
    system = make_system("triclinic")
    t0 = time.monotonic()
    try:
        if kind == "exception":
            config = DomainConfig(timeout=5)
            sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
            Pipeline([Group([Step(LennardJones(**LJ, cutoff=4.0))]), FailOnRank(1)], config=config)(sharded)
        elif kind == "nan":
            config = DomainConfig(timeout=5)
            sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
            if rank() == 1:
                sharded.positions = sharded.positions.clone()
                sharded.positions[0, 1] = float("nan")
            Pipeline([LennardJones(**LJ, cutoff=4.0)], config=config)(sharded)
        elif kind == "grid":
            ShardedSystem.scatter(system if rank() == 0 else None, DomainConfig(grid=(3, 1, 1), timeout=5))
        elif kind == "wrong_rank":
            ShardedSystem.scatter(system, DomainConfig(timeout=5))
        else:
            raise AssertionError(kind)
    except (DistributedError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc} [after {time.monotonic() - t0:.1f} s]"
    return "no error"


def reuse_frames(skin: float = 0.5) -> list[System]:
    """A, A rattled beyond the skin, and B with another atom count: frames one pipeline object evaluates in a row."""
    a = make_system("triclinic")
    moved = a.positions + torch.from_numpy(np.random.default_rng(1).normal(scale=skin, size=tuple(a.positions.shape)))
    rattled = System(positions=moved, numbers=a.numbers, cell=a.cell, pbc=a.pbc, fields=dict(a.fields))
    return [a, rattled, make_system("small_box"), a]


def reuse_case(skin: float = 0.5) -> list[dict] | None:
    """Each frame freshly scattered and evaluated by one reused pipeline object and by a fresh one; differences on rank 0."""
    config = DomainConfig(skin=skin, timeout=60)
    reused_dp, reused_single = make_pipeline("all", config=config), make_pipeline("all", skin)
    diffs = []
    for frame in reuse_frames(skin):
        results = []
        for dp in (reused_dp, make_pipeline("all", config=config)):
            sharded = ShardedSystem.scatter(frame if rank() == 0 else None, config)
            out = dp(sharded, stress=True)
            results.append((float(out["energy"]), sharded.gather(out["forces"]), sharded.gather(out["fields"]["charges"])))
        if rank() == 0:
            single = [reused_single(frame, stress=True, decompose=False), make_pipeline("all", skin)(frame, stress=True, decompose=False)]
            (e_reused, f_reused, q_reused), (e_fresh, f_fresh, q_fresh) = results
            diffs.append(
                {
                    "n_atoms": frame.n_atoms,
                    "distributed_energy": abs(e_reused - e_fresh) / abs(e_fresh),
                    "distributed_force": float((f_reused - f_fresh).abs().max()),
                    "distributed_charges": float((q_reused - q_fresh).abs().max()),
                    "single_energy": abs(float(single[0]["energy"] - single[1]["energy"])) / abs(float(single[1]["energy"])),
                    "single_force": float((single[0]["forces"] - single[1]["forces"]).abs().max()),
                    "vs_single_force": float((f_fresh - single[1]["forces"]).abs().max()),
                }
            )
    return diffs if rank() == 0 else None


def unchanged_script(skin: float = 0.5) -> dict:
    """A single-process script run as is on every rank: ``pipeline(system)`` splits itself over the ranks.

    Rank 0 passes the system, other ranks ``None`` in the second call. The
    reference is the same pipeline kept on this process (``decompose=False``).
    """
    system = make_system("triclinic")
    pipeline = make_pipeline("all", skin)
    out = pipeline(system, stress=True)
    again = pipeline(system if rank() == 0 else None, stress=True)
    ref = pipeline(system, stress=True, decompose=False)
    wrong_skin = ShardedSystem.scatter(system if rank() == 0 else None, DomainConfig(skin=skin + 0.25, timeout=60))
    try:
        pipeline(wrong_skin)
        mismatch = "no error"
    except (DistributedError, ValueError) as exc:
        mismatch = str(exc)
    return {
        "world": dist.get_world_size(),
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "again_energy_rel": abs(float(again["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "force": float((out["forces"] - ref["forces"]).abs().max()),
        "energies": float((out["energies"] - ref["energies"]).abs().max()),
        "charges": float((out["fields"]["charges"] - ref["fields"]["charges"]).abs().max()),
        "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
        "shape": tuple(out["forces"].shape),
        "mismatch": mismatch,
    }


def halo_rows_of_every_shape(width: float, shared_memory: bool = True) -> dict:
    """Refresh and fold of per-atom tensors of several row shapes, against references made from global ids alone.

    Values are small integers (exact in float64 whatever the order of a sum):
    a refreshed ghost row must be its owner's row, found by id; a folded
    owned row must be the sum of every rank's ghost rows of that atom, added
    up here with numpy from all ranks' (id, value) lists. The plan nests a
    narrower band (3 Å) under ``width``: the rows of each, and the narrower
    band's ghosts are those of a plan made for 3 Å alone. ``shared_memory``
    False: every message through gloo.
    """
    if not shared_memory:
        os.environ["HALOPIPE_SHM_CAPACITY"] = "0"  # read when this process makes its first communicator
    system = make_system("triclinic")
    config = DomainConfig(skin=0.0, timeout=60)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    sharded.prepare([3.0, width])
    out = {"ghosts": 0, "refresh": True, "fold": True, "shared_memory": sharded.comm._shm is not None}
    for w in (3.0, width):
        ids, ghost_ids = sharded.ids, sharded.ghost_ids[: sharded.ghost_count(w)]
        out["ghosts"] = int(ghost_ids.numel())
        for shape in [(), (3,), (4,), (2, 3)]:
            width_of_row = int(np.prod(shape, dtype=int))
            refreshed = sharded.ghost_rows(_rows_of_ids(ids, shape, 1), w)
            out["refresh"] &= torch.equal(refreshed, _rows_of_ids(ghost_ids, shape, 1))
            per_image = (torch.arange(ghost_ids.numel(), dtype=torch.float64) % 5).reshape((-1,) + (1,) * len(shape))  # images differ
            ghost_values = _rows_of_ids(ghost_ids, shape, 0) + per_image
            folded = sharded.fold_ghosts(ghost_values, w)
            everyone = sharded.comm.all_gather_object((ghost_ids.numpy(), ghost_values.reshape(ghost_ids.numel(), -1).numpy()))
            expected = np.zeros((system.n_atoms, max(width_of_row, 1)))
            for their_ids, their_values in everyone:
                np.add.at(expected, their_ids, their_values)
            out["fold"] &= bool(np.array_equal(folded.reshape(ids.numel(), -1).numpy(), expected[ids.numpy()]))
    alone = ShardedSystem.scatter(system if rank() == 0 else None, config)
    alone.prepare(3.0)
    narrow, only = sharded.ghost_count(3.0), alone.ghost_count(3.0)
    out["band_is_its_own_plan"] = _ghost_images(sharded, narrow) == _ghost_images(alone, only) and 0 < narrow < out["ghosts"]
    return out


def _ghost_images(sharded: ShardedSystem, n_ghost: int) -> list[tuple[int, ...]]:
    """The first ``n_ghost`` ghost rows as sorted (id, lattice shift) tuples."""
    return sorted((i, *s) for i, s in zip(sharded.ghost_ids[:n_ghost].tolist(), sharded.ghost_shift[:n_ghost].tolist()))


def _rows_of_ids(ids: torch.Tensor, shape: tuple, salt: int) -> torch.Tensor:
    """Rows of ``shape`` with small integer values made from each row's id: ``7 id + salt + k`` at the row's k-th element."""
    code = torch.arange(int(np.prod(shape, dtype=int)), dtype=torch.float64).reshape(shape)
    return (ids.to(torch.float64) * 7 + salt).reshape((-1,) + (1,) * len(shape)) + code
