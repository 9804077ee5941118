"""Every model on ranks that own no atoms, run on spawned ranks (importable by child processes).

The system is a slab: four layers of atoms about 7 Å thick in a periodic cell
36 Å high, cut into four bricks along z (9 Å each). At ``bottom=1`` (atoms at
z = 1..8 Å) brick 0 owns every atom; brick 1 receives ghosts from the slab's
top, brick 3 ghosts from the periodic image of its bottom, and brick 2
(18..27 Å, 10 Å from any atom) has no ghost rows for the short-range models.
At ``bottom=6`` the slab straddles bricks 0 and 1, which share the work, and
bricks 2 and 3 own nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from halopipe import DFTD3, MACE, PME, ChargeModel, DomainConfig, DSFCoulomb, Ewald, Group, LennardJones, Pipeline, Step, System, TorchModel
from halopipe.distributed import ShardedSystem

from ._workers import rank

GRID = (1, 1, 4)
SPECIES = (1, 6, 8)


def slab(bottom: float = 1.0, seed: int = 0) -> System:
    """A jittered 4 x 4 x 4 lattice of H, C, O with random neutral charges, in a tall periodic cell."""
    rng = np.random.default_rng(seed)
    spacing = 2.3
    grid = np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3).astype(float)
    positions = spacing * (grid + rng.uniform(-0.08, 0.08, grid.shape)) + np.array([0.5, 0.5, bottom])
    cell = np.diag([4 * spacing, 4 * spacing, 36.0]) + np.array([[0, 0, 0], [0.4, 0, 0], [0, 0, 0]])
    charges = rng.normal(scale=0.4, size=len(grid))
    charges -= charges.mean()
    return System(
        positions=torch.tensor(positions),
        numbers=torch.tensor(rng.choice(SPECIES, len(grid))),
        cell=torch.tensor(cell),
        pbc=[True] * 3,
        fields={"charges": torch.tensor(charges)},
    )


def pipelines(names: list[str]) -> dict[str, Pipeline]:
    """One pipeline per model (direct and autograd where a model offers both), plus wired charges."""
    return {name: _pipeline(name) for name in names}


def _pipeline(name: str) -> Pipeline:
    if name == "lj_direct":
        return Pipeline([Group([Step(LennardJones(0.01, 2.0, cutoff=5.0))], autograd=False)])
    if name == "lj_autograd":
        return Pipeline([Group([Step(LennardJones(0.01, 2.0, cutoff=5.0))], autograd=True)])
    if name == "dsf":
        return Pipeline([DSFCoulomb(6.0, 0.2)])
    if name == "charges_dsf":  # wired: the chain term crosses into empty ranks' ghost rows
        return Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05, hardness=1.0)), Step(DSFCoulomb(6.0, 0.2))])])
    if name == "d3_direct":
        return Pipeline([Group([Step(DFTD3("pbe", cutoff=8.0, cn_cutoff=5.0, s9=1.0, atm_cutoff=5.0))], autograd=False)])
    if name == "d3_autograd":
        return Pipeline([Group([Step(DFTD3("pbe", cutoff=8.0, cn_cutoff=5.0))], autograd=True)])
    if name == "ewald":
        return Pipeline([Ewald(cutoff=5.0, accuracy=1e-6)])
    if name == "charges_pme":
        return Pipeline([Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(PME(cutoff=5.0, accuracy=1e-5, order=5))])])
    if name.startswith("mace_"):
        from ..models.test_mace import build_model  # imports mace first (e3nn constants)

        return Pipeline([MACE(build_model("scaleshift_L2_corr3"), halo_mode=name.removeprefix("mace_"))])
    if name.startswith("torch_"):
        from ..models.test_adapter import MessagePassing

        net = MessagePassing(cutoff=3.5, features=8, layers=3).double()
        return Pipeline([TorchModel(net, cutoff=net.cutoff, layers=net.n_layers, per_layer=name == "torch_per_layer")])
    raise ValueError(name)


def _per_rank(sharded: ShardedSystem, count: int) -> torch.Tensor:
    """Each rank's ``count``, on every rank."""
    return sharded.all_reduce(torch.nn.functional.one_hot(torch.tensor(sharded.rank), sharded.world_size) * count)


def empty_rank_cases(names: list[str], bottom: float) -> dict | None:
    """Distributed vs single-process for each model; on rank 0 the differences, and what each rank owned."""
    system = slab(bottom)
    config = DomainConfig(grid=GRID, skin=0.0, timeout=120)  # skin 0: the slab layout leaves one rank without any row
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    owned = _per_rank(sharded, sharded.n_owned)
    results = {"owned_per_rank": owned.tolist(), "ghosts_per_rank": {}}
    for name, pipeline in pipelines(names).items():
        pipeline.config = config
        out = pipeline(sharded, stress=True)
        ghosts = _per_rank(sharded, sharded.ghost_count(pipeline.halo))
        forces = sharded.gather(out["forces"])
        if rank() != 0:
            continue
        ref = pipeline(system, stress=True, decompose=False)
        results["ghosts_per_rank"][name] = ghosts.tolist()
        results[name] = {
            "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
            "force": float((forces - ref["forces"]).abs().max()),
            "force_scale": float(ref["forces"].abs().max()),
            "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
        }
    return results if rank() == 0 else None
