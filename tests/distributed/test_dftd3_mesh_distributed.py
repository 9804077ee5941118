"""D3(BJ) by particle mesh under domain decomposition equals one process (gloo, CPU).

Reference: the same pipeline on rank 0 in one process (``decompose=False``: the whole mesh, one batched
rFFT). Decomposed: each rank spreads its owned atoms onto its box, the channels run through the
distributed FFT (``mesh="slab"`` or ``"pencil"``), ghost rows carry the CN list's forces home.
Tolerances: forces 1e-10 eV/Å, energy 1e-12 relative, stress 1e-12 relative to its largest component.
Cases: 64 rattled Si (one element, rank 3), a C/H/O molecular crystal (three elements, so pair-dependent
damping across channels), Si with the real-space ATM term (ghost CNs refreshed from owners), and one
methanol and one formic acid molecule in a large triclinic cell cut into more bricks than the molecules
occupy, so that ranks own no atoms (they still hold a block of the mesh and meet every transform).
2, 4 and 8 ranks; slab and pencil meshes (on 4 ranks a 2 x 2 pencil grid, on 8 a 2 x 4 or 4 x 2 one). The ATM
term runs on 2 ranks only (its real-space sum is DFTD3's, tested on more ranks in test_dftd3_ranks.py).
"""

from __future__ import annotations

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


def sparse() -> Atoms:
    """Methanol and formic acid (11 atoms) near the origin of a 16-17 Å triclinic cell: most bricks own no atom."""
    second = molecule("HCOOH")
    second.positions += [0.4, 3.2, 0.3]
    atoms = molecule("CH3OH") + second
    atoms.cell = cellpar_to_cell([16.0, 16.5, 17.0, 84.0, 93.0, 98.0])
    atoms.pbc = True
    atoms.positions += 2.2
    atoms.rattle(0.03, seed=5)
    return atoms


SYSTEMS = {"silicon": silicon, "crystal": molecular_crystal, "sparse": sparse}
MODELS = {
    "slab": lambda: DFTD3Mesh("pbe", cn_cutoff=12.1, mesh="slab"),
    "pencil": lambda: DFTD3Mesh("b3lyp", cn_cutoff=12.1, mesh="pencil"),
    "atm": lambda: DFTD3Mesh("pbe", cn_cutoff=8.1, s9=1.0, atm_cutoff=7.2, mesh="slab"),
    "sparse_slab": lambda: DFTD3Mesh("b3lyp", cn_cutoff=10.0, accuracy=1e-4, mesh="slab"),
    "sparse_pencil": lambda: DFTD3Mesh("pbe", cn_cutoff=10.0, accuracy=1e-4, mesh="pencil"),
}


def decomposed_vs_one_process(cases: list[tuple[str, str, tuple[int, int, int]]]) -> list[dict] | None:
    """Each ``(system, model kind, brick grid)``: the decomposed evaluation against one process (rank 0 reports)."""
    import torch
    import torch.distributed as dist

    results = []
    for name, kind, grid in cases:
        system = System.from_ase(SYSTEMS[name]())
        model = MODELS[kind]()
        pipeline = Pipeline([Group([Step(model)], autograd=True)], config=DomainConfig(grid=grid, timeout=100))
        sharded = ShardedSystem.scatter(system if dist.get_rank() == 0 else None, pipeline.config)
        out = pipeline(sharded, stress=True)
        forces = sharded.gather(out["forces"])
        owned = sharded.all_reduce(torch.nn.functional.one_hot(torch.tensor(dist.get_rank()), dist.get_world_size()) * sharded.n_owned)
        grids = [None] * dist.get_world_size()
        transforms = [(tuple(t.sizes), tuple(t.grid)) for t in sharded._mesh_transforms.values()]
        dist.all_gather_object(grids, transforms)
        if dist.get_rank() != 0:
            continue
        ref = pipeline(system, stress=True, decompose=False)
        energy, ref_energy = float(out["energy"]), float(ref["energy"])
        results.append(
            {
                "case": (name, kind, grid),
                "rank": model.decomposition.rank,
                "owned": owned.tolist(),
                "transforms": grids,
                "energy_rel": abs(energy - ref_energy) / abs(ref_energy),
                "force": float((forces - ref["forces"]).abs().max()),
                "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
                "largest_force": float(ref["forces"].abs().max()),
            }
        )
    return results


CASES = {
    2: [
        ("silicon", "slab", (2, 1, 1)),
        ("crystal", "pencil", (1, 2, 1)),
        ("silicon", "atm", (1, 1, 2)),
    ],
    4: [
        ("silicon", "slab", (4, 1, 1)),
        ("crystal", "pencil", (2, 2, 1)),
        ("sparse", "sparse_pencil", (2, 2, 1)),
    ],
    # 8 processes share CI's 2 cores: one case (ranks without atoms are covered on 4)
    8: [("sparse", "sparse_slab", (2, 2, 2))],
}


def check(results: list[dict], world_size: int) -> None:
    assert len(results) == len(CASES[world_size])
    for r in results:
        assert r["energy_rel"] <= 1e-12, r
        assert r["force"] <= 1e-10, r
        assert r["stress_rel"] <= 1e-12, r
        assert r["largest_force"] > 1e-3, r  # the comparison is not of zeros
        assert r["rank"] >= 3, r
        # The mesh really was shared: one transform per rank, all on the same process grid of the requested kind.
        (sizes, grid), *more = r["transforms"][0]
        assert not more and all(t == [(sizes, grid)] for t in r["transforms"]), r
        assert grid[0] * grid[1] == world_size, r
        kind = "slab" if r["case"][1].endswith("slab") or r["case"][1] == "atm" else "pencil"
        assert (grid[1] == 1) == (kind == "slab"), r
        if r["case"][0] == "sparse":
            assert r["owned"].count(0) >= world_size // 2 and sum(r["owned"]) == 11, r  # ranks without atoms


@pytest.mark.timeout(240)
def test_two_ranks_equal_one_process() -> None:
    check(spawn(decomposed_vs_one_process, 2, CASES[2], timeout=220)[0], 2)


@pytest.mark.timeout(240)
def test_four_ranks_equal_one_process_slab_pencil_and_empty_ranks() -> None:
    check(spawn(decomposed_vs_one_process, 4, CASES[4], timeout=220)[0], 4)


@pytest.mark.timeout(240)
def test_eight_ranks_equal_one_process() -> None:
    check(spawn(decomposed_vs_one_process, 8, CASES[8], timeout=220)[0], 8)
