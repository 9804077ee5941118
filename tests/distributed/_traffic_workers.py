"""Rank functions for the neighbour-traffic tests: who a rank talks to in steps and rebuilds."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from halopipe import Group, LennardJones, Pipeline, Step, System
from halopipe.distributed import DomainConfig, ShardedSystem

A = 5.26  # fcc argon lattice constant, Å; a brick is 2 cells (10.52 Å) wide on every axis
PLANE_OFFSET = 0.3  # the lattice sits this far below the bricks' faces: each brick has a plane 0.3 Å below its upper face
CUTOFF, SKIN = 5.0, 1.0  # a plan's peers lie within 5 + 2 * 1 = 7 Å < 10.52 Å: only the two neighbours along x


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def argon_chain(bricks: int, seed: int = 0) -> System:
    """``bricks`` bricks of 2x2x2 fcc cells along x (32 atoms each); small noise keeps every brick alike."""
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=A, cubic=True).repeat((2 * bricks, 2, 2))
    atoms.positions[:, 0] -= PLANE_OFFSET
    atoms.positions += np.random.default_rng(seed).normal(scale=0.01, size=atoms.positions.shape)
    return System.from_ase(atoms)


def pipeline(config: DomainConfig) -> Pipeline:
    lj = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF)
    soft = LennardJones(0.002, 3.0, cutoff=4.0)  # an autograd group: its refresh backward travels too
    return Pipeline([Group([Step(lj)], autograd=False), Group([Step(soft, name="autograd")])], config=config)


class Spy:
    """Records, on one communicator, the ranks each message goes to and whether an all-to-all ran."""

    def __init__(self, comm) -> None:
        self.comm, self.peers, self.all_to_alls = comm, set(), 0
        exchange, all_to_all_into = comm.exchange, comm.all_to_all_into

        def spied_exchange(sends, recv_shapes, dtype, device, **options):
            self.peers |= {r for r, t in sends.items() if t.shape[0] and r != comm.rank}
            return exchange(sends, recv_shapes, dtype, device, **options)

        def spied_all_to_all_into(sends, outs):
            self.all_to_alls += 1
            return all_to_all_into(sends, outs)

        comm.exchange, comm.all_to_all_into = spied_exchange, spied_all_to_all_into

    def counters(self) -> tuple[int, int]:
        return self.comm.messages_sent, self.comm.bytes_sent


def neighbour_traffic(bricks: int) -> dict:
    """Messages and bytes this rank sends in one step without a rebuild and in one with a rebuild and migration."""
    system = argon_chain(bricks)
    config = DomainConfig(grid=(bricks, 1, 1), skin=SKIN, timeout=60)
    pipe = pipeline(config)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    pipe(sharded)  # the first plan
    spy = Spy(sharded.comm)
    out = {"rank": rank()}
    for phase, shift in (("step", 0.2), ("rebuild", 0.9)):  # 0.2 < skin/2: no rebuild; 0.9: one plane moves right
        rebuilds, owned = sharded.rebuilds, sharded.ids.clone()
        before = spy.counters()
        sharded.positions = sharded.positions + torch.tensor([shift, 0.0, 0.0], dtype=torch.float64)
        pipe(sharded)
        after = spy.counters()
        out[phase] = {
            "messages": after[0] - before[0],
            "bytes": after[1] - before[1],
            "rebuilt": sharded.rebuilds - rebuilds,
            "migrated": not torch.equal(owned, sharded.ids),
        }
    out["peers"] = sorted(spy.peers)
    out["all_to_alls"] = spy.all_to_alls
    return out


def far_jump(bricks: int, atom: int, jump: float) -> dict | None:
    """Atom ``atom`` jumps ``jump`` Å along x between two evaluations; compare with one process on the same positions."""
    system = argon_chain(bricks, seed=1)
    config = DomainConfig(grid=(bricks, 1, 1), skin=SKIN, timeout=60)
    pipe = pipeline(config)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    pipe(sharded)
    spy = Spy(sharded.comm)
    positions = system.positions.clone()
    positions[atom, 0] += jump
    mine = sharded.ids == atom
    sharded.positions = torch.where(mine[:, None], positions[sharded.ids], sharded.positions)
    out = pipe(sharded, stress=True)
    owner = sharded.all_reduce(torch.tensor([rank() if bool((sharded.ids == atom).any()) else -1]), "max")
    forces = sharded.gather(out["forces"])
    owned = sharded.gather(torch.ones(sharded.n_owned, dtype=torch.int64))
    all_to_alls = sharded.all_reduce(torch.tensor([spy.all_to_alls]), "max")
    if rank() != 0:
        return None
    ref = pipe(system.replace(positions=positions), stress=True, decompose=False)
    return {
        "owner": int(owner),
        "owned_once": bool((owned == 1).all()),
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "force": float((forces - ref["forces"]).abs().max()),
        "stress": float((out["stress"] - ref["stress"]).abs().max()),
        "all_to_alls": int(all_to_alls),
    }
