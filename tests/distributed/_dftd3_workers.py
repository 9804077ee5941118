"""DFT-D3 evaluated on spawned ranks (importable by child processes): domain decomposition against one process, and bad input."""

from __future__ import annotations

import numpy as np
from ase import Atoms
from ase.build import bulk
from ase.geometry import cellpar_to_cell

from halopipe import DFTD3, DomainConfig, Group, Pipeline, Step, System
from halopipe.distributed import ShardedSystem

from ._lifetime_workers import record_pids
from ._workers import rank

# Small cutoffs (Å) for the ATM cases: ATM at its 21.2 Å default costs minutes on these cells.
SMALL = dict(cutoff=12.3, cn_cutoff=8.1, atm_cutoff=7.2)


def silicon(seed: int = 7) -> Atoms:
    """64 atoms of diamond Si (2x2x2 conventional cells, 10.86 Å), rattled by 0.05 Å."""
    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=seed)
    return atoms


def triclinic() -> Atoms:
    """A 5-atom cell of 5.3-6.8 Å with angles 63°, 112°, 72° (heights 4.0-4.8 Å), repeated 2x2x1 (20 atoms)."""
    cell = cellpar_to_cell([5.3, 6.1, 6.8, 63.0, 112.0, 72.0])
    frac = np.array([[0.1, 0.2, 0.3], [0.45, 0.4, 0.25], [0.3, 0.75, 0.7], [0.8, 0.15, 0.6], [0.6, 0.6, 0.95]])
    return Atoms("SiCNOTi", scaled_positions=frac, cell=cell, pbc=True).repeat((2, 2, 1))


SYSTEMS = {"silicon": silicon, "triclinic": triclinic}


def model(kind: str) -> DFTD3:
    """``"default"``: D3(BJ)/PBE at the default cutoffs; ``"atm"``: D3(BJ)-ATM (s9 = 1) at :data:`SMALL`."""
    if kind == "default":
        return DFTD3("pbe", "bj")
    if kind == "atm":
        return DFTD3("pbe", "bj", s9=1.0, **SMALL)
    raise ValueError(kind)


def decomposed_vs_one_process(cases: list[tuple[str, str, tuple[int, int, int]]]) -> list[dict] | None:
    """Each ``(system, model kind, grid)``: the decomposed evaluation against one process (rank 0 reports)."""
    results = []
    for name, kind, grid in cases:
        system = System.from_ase(SYSTEMS[name]())
        pipeline = Pipeline([Group([Step(model(kind))], autograd=True)], config=DomainConfig(grid=grid, timeout=120))
        sharded = ShardedSystem.scatter(system if rank() == 0 else None, pipeline.config)
        out = pipeline(sharded, stress=True)
        forces = sharded.gather(out["forces"])
        if rank() != 0:
            continue
        ref = pipeline(system, stress=True, decompose=False)
        results.append(
            {
                "case": (name, kind, grid),
                "grid": tuple(sharded.grid),
                "energy": float(out["energy"]),
                "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
                "force": float((forces - ref["forces"]).abs().max()),
                "force_scale": float(ref["forces"].abs().max()),
                "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
            }
        )
    return results if rank() == 0 else None


def unknown_element(directory: str, where: str) -> None:
    """A Si cell with one atom of Z = 104 (no D3 reference data).

    ``"everywhere"``: the D3 halo spans the box, so every rank sees the atom;
    ``"one_rank"``: 2x1x1 bricks of 10.9 Å and 3 Å cutoffs, and the atom sits
    in the middle of brick 0, so with a halo only rank 0 holds it (owned) and only rank 0 raises; the others
    must learn of the failure from rank 0.
    """
    record_pids(directory)
    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat((4, 2, 2))  # 21.7 x 10.9 x 10.9 Å
    atoms.rattle(0.02, seed=1)
    target = np.array([5.4, 5.4, 5.4])
    atoms.numbers[int(np.argmin(np.linalg.norm(atoms.positions - target, axis=1)))] = 104
    d3 = DFTD3("pbe", "bj") if where == "everywhere" else DFTD3("pbe", "bj", cutoff=3.0, cn_cutoff=3.0)
    config = DomainConfig(grid=(2, 1, 1), timeout=120)
    system = System.from_ase(atoms)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    Pipeline([d3], config=config)(sharded, stress=True)
