"""Functions run on spawned ranks (and in-process as the 1-rank case) by the dynamics tests."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from halopipe import LennardJones, Pipeline, System
from halopipe.distributed import DomainConfig
from halopipe.dynamics import FIRE, Langevin, NoseHooverChain, Simulation, VelocityVerlet


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def argon(cells: int = 4, rattle: float = 0.05, seed: int = 0) -> System:
    """An fcc argon box (4 cells^3 atoms), rattled, identical on every rank."""
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((cells,) * 3)
    atoms.positions += np.random.default_rng(seed).normal(scale=rattle, size=atoms.positions.shape)
    return System.from_ase(atoms)


def lj() -> LennardJones:
    return LennardJones(epsilon=0.0104, sigma=3.4, cutoff=6.0)


def integrator(kind: str, timestep: float = 2.0):
    if kind == "nve":
        return VelocityVerlet(timestep)
    if kind == "langevin":
        return Langevin(timestep, temperature=400.0, friction=0.02, seed=11)
    if kind == "nhc":
        return NoseHooverChain(timestep, temperature=400.0, tdamp=50.0)
    if kind == "fire":
        return FIRE(timestep=1.0, fmax=1e-3)
    raise ValueError(kind)


def _owners(sim: Simulation) -> torch.Tensor:
    return sim.sharded.gather(torch.full((sim.sharded.n_owned,), sim.rank, dtype=torch.int64))


def invariance_run(kinds: tuple[str, ...], steps: int, temperature: float, skin: float) -> dict:
    """Run each integrator ``steps`` steps from a hot start; final positions (original order), rebuilds, migrations."""
    out = {}
    for kind in kinds:
        sim = Simulation(Pipeline([lj()], config=DomainConfig(skin=skin)), argon() if rank() == 0 else None, integrator(kind))
        sim.set_velocities(temperature, seed=5)
        before = _owners(sim)
        sim.run(steps)
        after = _owners(sim)
        final = sim.system()
        out[kind] = {
            "positions": final.positions,
            "velocities": final.fields["velocities"],
            "rebuilds": sim.sharded.rebuilds,
            "owner_changes": int((before != after).sum()),
            "world": sim.sharded.world_size,
        }
    return out if rank() == 0 else {}


def checkpoint_run(kind: str, steps: int, path: str | None, restart_from: str | None, every: int = 0) -> dict:
    """Run to ``steps`` (fresh, or restarted from ``restart_from``), writing checkpoints to ``path``; final state on rank 0."""
    potential = Pipeline([lj()], config=DomainConfig(skin=0.5))
    if restart_from is not None:
        sim = Simulation.restart(restart_from, potential, integrator(kind), checkpoint=path, checkpoint_every=every)
    else:
        sim = Simulation(potential, argon() if rank() == 0 else None, integrator(kind), checkpoint=path, checkpoint_every=every)
        sim.set_velocities(400.0, seed=5)
    sim.run(steps - sim.step)
    final = sim.system()
    state = sim.integrator.state_dict(sim.md)
    return {"positions": final.positions, "velocities": final.fields["velocities"], "step": sim.step, "state": state} if rank() == 0 else {}


def checkpoint_suite(directory: str, total: int, half: int, kind: str) -> dict:
    """On N ranks: an uninterrupted run, a run stopped at ``half``, and a restart of the 1-rank checkpoint ``one_rank.pt``."""
    full = checkpoint_run(kind, total, None, None)
    checkpoint_run(kind, half, f"{directory}/n_ranks.pt", None)
    resumed = checkpoint_run(kind, total, f"{directory}/resumed.pt", f"{directory}/one_rank.pt")
    return {"full": full, "resumed_from_1": resumed}
