"""D3(BJ) by particle mesh under domain decomposition equals one process (gloo, CPU).

Reference: the same pipeline on rank 0 in one process (``decompose=False``: the whole mesh, one batched
rFFT). Decomposed: each rank spreads its owned atoms onto its box, the channels run through the
distributed FFT (``mesh="slab"`` or ``"pencil"``), ghost rows carry the CN list's forces home.
Tolerances: forces 1e-10 eV/Å, energy 1e-12 relative, stress 1e-12 relative to its largest component.
Cases: 64 rattled Si (one element, rank 3), a C/H/O molecular crystal (three elements, so pair-dependent
damping across channels) and Si with the real-space ATM term (ghost CNs refreshed from owners).
"""

from __future__ import annotations

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.geometry import cellpar_to_cell

from halopipe import DomainConfig, Group, Pipeline, Step, System
from halopipe.distributed import ShardedSystem
from halopipe.distributed.launch import spawn
from halopipe.models.dftd3_mesh import DFTD3Mesh


def silicon() -> Atoms:
    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=7)
    return atoms


def molecular_crystal() -> Atoms:
    """Methanol and formic acid in a triclinic cell, repeated 2x1x1 (24 atoms)."""
    second = molecule("HCOOH")
    second.positions += [3.2, 2.9, 3.1]
    atoms = molecule("CH3OH") + second
    atoms.cell = cellpar_to_cell([6.1, 6.6, 7.0, 82.0, 95.0, 103.0])
    atoms.pbc = True
    atoms.positions += 1.0
    atoms = atoms.repeat((2, 1, 1))
    atoms.rattle(0.03, seed=3)
    return atoms


SYSTEMS = {"silicon": silicon, "crystal": molecular_crystal}
MODELS = {
    "slab": lambda: DFTD3Mesh("pbe", cn_cutoff=12.1, mesh="slab"),
    "pencil": lambda: DFTD3Mesh("b3lyp", cn_cutoff=12.1, mesh="pencil"),
    "atm": lambda: DFTD3Mesh("pbe", cn_cutoff=8.1, s9=1.0, atm_cutoff=7.2, mesh="slab"),
}


def decomposed_vs_one_process(cases: list[tuple[str, str, tuple[int, int, int]]]) -> list[dict] | None:
    """Each ``(system, model kind, brick grid)``: the decomposed evaluation against one process (rank 0 reports)."""
    import torch.distributed as dist

    results = []
    for name, kind, grid in cases:
        system = System.from_ase(SYSTEMS[name]())
        model = MODELS[kind]()
        pipeline = Pipeline([Group([Step(model)], autograd=True)], config=DomainConfig(grid=grid, timeout=100))
        sharded = ShardedSystem.scatter(system if dist.get_rank() == 0 else None, pipeline.config)
        out = pipeline(sharded, stress=True)
        forces = sharded.gather(out["forces"])
        if dist.get_rank() != 0:
            continue
        ref = pipeline(system, stress=True, decompose=False)
        energy, ref_energy = float(out["energy"]), float(ref["energy"])
        results.append(
            {
                "case": (name, kind, grid),
                "rank": model.decomposition.rank,
                "energy_rel": abs(energy - ref_energy) / abs(ref_energy),
                "force": float((forces - ref["forces"]).abs().max()),
                "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
                "largest_force": float(ref["forces"].abs().max()),
            }
        )
    return results


CASES = [
    ("silicon", "slab", (2, 1, 1)),
    ("crystal", "pencil", (1, 2, 1)),
    ("silicon", "atm", (1, 1, 2)),
]


@pytest.mark.timeout(240)
def test_two_ranks_equal_one_process() -> None:
    results = spawn(decomposed_vs_one_process, 2, CASES, timeout=220)[0]
    assert len(results) == len(CASES)
    for r in results:
        assert r["energy_rel"] <= 1e-12, r
        assert r["force"] <= 1e-10, r
        assert r["stress_rel"] <= 1e-12, r
        assert r["largest_force"] > 1e-3, r  # the comparison is not of zeros
    assert np.all([r["rank"] >= 3 for r in results])
