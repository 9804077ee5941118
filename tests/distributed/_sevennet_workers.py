"""SevenNet-0 cases run on spawned ranks (importable by child processes; needs the [sevenn] extra)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from halopipe import DFTD3, Group, Pipeline, SevenNet, Step, System
from halopipe.distributed import DomainConfig, ShardedSystem
from halopipe.geometry import Geometry

from ._composite_workers import compare
from ._workers import rank

D3_CUTOFF, D3_CN_CUTOFF = 12.0, 8.0


def crystal() -> System:
    """48-atom rattled rock salt in a sheared cell, heights ~6.5, 6.5 and 9.8 Å: bricks split along x or y are thinner than 5 Å."""
    from ..models.test_sevennet import triclinic_crystal

    return System.from_ase(triclinic_crystal(repeat=(2, 2, 3), seed=3))


def slab() -> System:
    """A NaCl slab filling less than half of a periodic cell along x: on 4 bricks along x, two own no atoms."""
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((1, 2, 2))
    atoms.rattle(0.1, seed=4)
    atoms.cell[0, 0] = 14.0
    return System.from_ase(atoms)


def thickest_split_brick(system: System, grid) -> float:
    """The largest brick height along the axes that are split."""
    heights = Geometry(system.cell, system.pbc).heights
    return float(max(h / g for h, g, p in zip(heights.tolist(), grid, system.pbc.tolist()) if p and g > 1))


def sevennet_cases(grid) -> list:
    """SevenNet-0 (per-layer refresh) alone and + DFTD3 on the crystal, alone on the slab; float64."""
    model = SevenNet("7net-0", dtype="float64")
    system = crystal()
    results = [
        compare(system, Pipeline([model]), grid=grid),
        compare(system, Pipeline([Group([Step(model), Step(DFTD3("pbe", cutoff=D3_CUTOFF, cn_cutoff=D3_CN_CUTOFF))])]), grid=grid),
    ]
    if rank() == 0 and grid is not None and max(grid) > 1:
        thickest = thickest_split_brick(system, grid)
        results = [dict(r, thickest_split_brick=thickest) for r in results]
    return results


def empty_rank_case() -> dict | None:
    """The slab on 4 bricks along x: ranks without atoms take part in every refresh and contribute zero."""
    system = slab()
    config = DomainConfig(grid=(4, 1, 1), timeout=120)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    owned = torch.tensor([float(sharded.n_owned)])
    dist.all_reduce(owned, op=dist.ReduceOp.MIN)
    result = compare(system, Pipeline([SevenNet("7net-0", dtype="float64")]), grid=(4, 1, 1))
    return None if result is None else dict(result, fewest_owned=int(owned))


def wide_halo_case(grid) -> dict | None:
    """The wide halo (25 Å, no refresh) on a non-periodic molecule."""
    from ..models.test_sevennet import molecule_system

    return compare(System.from_ase(molecule_system()), Pipeline([SevenNet("7net-0", halo_mode="wide", dtype="float64")]), grid=grid)
