"""Functions run on spawned ranks (and in-process as the 1-rank case) by the constant-pressure tests."""

from __future__ import annotations

import torch

from halopipe import Pipeline, System
from halopipe.distributed import DomainConfig, ShardedSystem
from halopipe.dynamics import MTKNPT, AnisotropicCellRescaling, IsotropicMTKNPT, Simulation, StochasticCellRescaling

from ._workers import argon, lj, rank

# A hot, over-compressed start at a low target pressure: the box expands by ~30 % in 200 steps.
TEMPERATURE, PRESSURE, SKIN = 300.0, 500.0, 0.4


# A sheared, stretched start for the anisotropic barostats: the stress is anisotropic, so the cell changes shape.
SHEAR = ((1.0, 0.0, 0.0), (0.08, 0.97, 0.0), (0.05, 0.04, 1.04))


def npt(timestep: float = 2.0, kind: str = "mtk"):
    if kind == "csr":
        return StochasticCellRescaling(timestep, TEMPERATURE, PRESSURE, compressibility=1e-4, taup=200.0, friction=0.01, seed=3)
    if kind == "csr_tri":
        return AnisotropicCellRescaling(timestep, TEMPERATURE, PRESSURE, compressibility=1e-4, taup=200.0, friction=0.01, seed=3)
    if kind == "mtk_tri":
        return MTKNPT(timestep, TEMPERATURE, PRESSURE, tdamp=50.0, pdamp=200.0)
    return IsotropicMTKNPT(timestep, TEMPERATURE, PRESSURE, tdamp=50.0, pdamp=200.0)


def sheared_argon(cells: int = 3) -> System:
    """The rattled argon box with cell and atoms mapped by :data:`SHEAR` (a triclinic cell)."""
    start = argon(cells=cells)
    deform = torch.tensor(SHEAR, dtype=start.cell.dtype)
    return System(positions=start.positions @ deform, numbers=start.numbers, cell=start.cell @ deform, pbc=start.pbc, masses=start.masses)


def start_system(kind: str) -> System:
    return sheared_argon() if kind.endswith("_tri") else argon(cells=3)


def _final(sim: Simulation, owners_before: torch.Tensor) -> dict:
    """The final state on rank 0 (``{}`` elsewhere), as numpy arrays.

    Plain arrays, not tensors: torch sends a tensor through a multiprocessing
    queue as a file descriptor that the parent can only fetch while the sending
    rank is alive, and a rank returns just before it exits.
    """
    final = sim.system()
    owners = _owners(sim)
    thermo, state = sim.thermo(), sim.integrator.state_dict(sim.md)  # collective
    if rank() != 0:
        return {}
    return {
        "positions": final.positions.numpy(),
        "velocities": final.fields["velocities"].numpy(),
        "cell": final.cell.numpy().copy(),
        "step": sim.step,
        "state": state,
        "thermo": thermo,
        "rebuilds": sim.sharded.rebuilds,
        "owner_changes": int((owners != owners_before).sum()),
        "world": sim.sharded.world_size,
    }


def _owners(sim: Simulation) -> torch.Tensor:
    return sim.sharded.gather(torch.full((sim.sharded.n_owned,), sim.rank, dtype=torch.int64))


def npt_run(steps: int, path: str | None = None, restart_from: str | None = None, kind: str = "mtk") -> dict:
    """NPT for ``steps`` steps in all (fresh or restarted from ``restart_from``), checkpointing to ``path``."""
    potential = Pipeline([lj()], config=DomainConfig(skin=SKIN))
    if restart_from is not None:
        sim = Simulation.restart(restart_from, potential, npt(kind=kind), checkpoint=path)
    else:
        sim = Simulation(potential, start_system(kind) if rank() == 0 else None, npt(kind=kind), checkpoint=path)
        sim.set_velocities(TEMPERATURE, seed=5)
    before = _owners(sim)
    sim.run(steps - sim.step)
    return _final(sim, before)


def strained_forces(system, scales: list, skin: float, model=None) -> list[dict]:
    """Evaluate, then again with cell and positions ``scale`` times the originals, per scale (numpy, on rank 0)."""
    model = model if model is not None else lj()
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, DomainConfig(skin=skin))
    potential = Pipeline([model], config=DomainConfig(skin=skin))
    potential(sharded, stress=True)
    cell, positions = sharded.cell.clone(), sharded.positions.clone()
    out = []
    for scale in scales:  # a number (isotropic) or a (3, 3) deformation applied to row vectors
        deform = torch.as_tensor(scale, dtype=cell.dtype) * torch.eye(3, dtype=cell.dtype) if isinstance(scale, float) else scale
        sharded.set_cell(cell @ deform)
        sharded.positions = positions @ deform
        before = sharded.rebuilds
        result = potential(sharded, stress=True)
        out.append(
            {
                "energy": float(result["energy"]),
                "stress": result["stress"].numpy(),
                "forces": sharded.gather(result["forces"]).numpy(),
                "rebuilt": sharded.rebuilds > before,
            }
        )
    return out if rank() == 0 else []


def npt_ewald_run(steps: int) -> dict:
    """Triclinic MTK on charged, triclinic NaCl (LJ + Ewald); the final state and a fresh evaluation of it (rank 0)."""
    from halopipe import Ewald, LennardJones

    from ..conftest import triclinic_nacl

    def potential() -> Pipeline:  # LJ with its minimum at the Na-Cl distance keeps the ions apart
        return Pipeline(
            [LennardJones(epsilon=0.01, sigma=2.5, cutoff=6.0), Ewald(cutoff=6.0, accuracy=1e-8)], config=DomainConfig(skin=0.5)
        )

    integrator = MTKNPT(1.0, 300.0, PRESSURE, tdamp=50.0, pdamp=100.0)
    sim = Simulation(potential(), triclinic_nacl() if rank() == 0 else None, integrator)
    sim.set_velocities(300.0, seed=2)
    sim.run(steps)
    final = sim.system()
    forces = sim.sharded.gather(sim.md.forces)
    stress = sim.md.stress
    if rank() != 0:
        return {}
    fresh = potential()(final, stress=True, decompose=False)
    return {
        "positions": final.positions.numpy(),
        "cell": final.cell.numpy().copy(),
        "forces": forces.numpy(),
        "stress": stress.numpy(),
        "fresh_forces": fresh["forces"].numpy(),
        "fresh_stress": fresh["stress"].numpy(),
    }
