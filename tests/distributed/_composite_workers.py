"""Composites of the physics models, evaluated on spawned ranks (importable by child processes)."""

from __future__ import annotations

import numpy as np

from halopipe import DFTD3, PME, ChargeModel, Ewald, Group, LennardJones, Pipeline, Step, System
from halopipe.distributed import DomainConfig, ShardedSystem

from ._workers import rank

LJ = dict(epsilon={11: 0.0115, 17: 0.0043, 8: 0.0067, 1: 0.0019}, sigma={11: 2.6, 17: 3.6, 8: 3.0, 1: 2.0})


def salt(repeat=(3, 3, 3), seed: int = 0) -> System:
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64).repeat(repeat)
    rng = np.random.default_rng(seed)
    atoms.positions += rng.normal(scale=0.15, size=atoms.positions.shape)
    atoms.set_cell(atoms.cell.array + np.array([[0, 0.3, 0.2], [0.5, 0, 0.1], [0.1, 0.6, 0]]), scale_atoms=True)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def composite(name: str) -> Pipeline:
    """The composites of the physics issue: (a) to (d)."""
    if name == "a_lj_d3_direct":
        return Pipeline([Group([Step(LennardJones(**LJ, cutoff=6.0)), Step(DFTD3("pbe", cutoff=8.0, cn_cutoff=6.0))], autograd=False)])
    if name == "b_charges_ewald_lj":
        return Pipeline(
            [
                Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(Ewald(cutoff=6.0, accuracy=1e-5))], autograd=True),
                Group([Step(LennardJones(**LJ, cutoff=6.0))], autograd=False),
            ]
        )
    if name == "c_charges_pme":
        return Pipeline(
            [Group([Step(ChargeModel(3.5, coordination_weight=0.05)), Step(PME(cutoff=6.0, accuracy=1e-4, order=4))], autograd=True)]
        )
    if name == "d_d3_wide":  # 2-body cutoff wider than a brick (bricks are 4-8 Å here)
        return Pipeline([Group([Step(DFTD3("b3lyp", damping="zero", cutoff=12.0, cn_cutoff=7.0))], autograd=True)])
    raise ValueError(name)


def compare(system: System, pipeline: Pipeline, grid=None, halo: str = "per_model") -> dict | None:
    stress = bool(system.pbc.all())
    config = DomainConfig(grid=grid, halo=halo, timeout=120)
    pipeline = Pipeline(pipeline.groups, config=config)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    out = pipeline(sharded, stress=stress)
    forces = sharded.gather(out["forces"])
    if rank() != 0:
        return None
    ref = pipeline(system, stress=stress, decompose=False)
    result = {
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "force": float((forces - ref["forces"]).abs().max()),
        "force_scale": float(ref["forces"].abs().max()),
        "halo": out["halo"],
        "grid": sharded.grid,
    }
    if stress:
        result["stress_rel"] = float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max())
    return result


def physics_composites(names: list[str]) -> list:
    return [compare(salt(), composite(name)) for name in names]


# ------------------------------------------------------------------------------------------- MACE
def mace_cases(modes: list[str]) -> list:
    """A random-weight MACE alone (both halo modes) and MACE + DFTD3, on a periodic and a non-periodic system."""
    from halopipe import MACE

    from ..models.test_mace import build_model, make_atoms  # imports mace first (e3nn constants)

    module = build_model("scaleshift_L2_corr3")
    results = []
    for periodic in (True, False):
        system = System.from_ase(make_atoms(periodic, n_side=4, seed=1))
        for mode in modes:
            results.append(compare(system, Pipeline([MACE(module, halo_mode=mode)])))
        both = Pipeline([Group([Step(MACE(module)), Step(DFTD3("pbe", cutoff=9.0, cn_cutoff=6.0))], autograd=True)])
        results.append(compare(system, both))
    return results


# --------------------------------------------------------------------------- bring your own model
def adapter_cases(kinds: list[str]) -> list:
    """The plain-torch example network through TorchModel, per-layer refresh and wide halo."""
    from halopipe import TorchModel

    from ..models.test_adapter import MessagePassing, make_atoms

    net = MessagePassing(cutoff=3.5, features=8, layers=3).double()
    results = []
    for kind in kinds:
        system = System.from_ase(make_atoms(kind))
        for per_layer in (True, False):
            model = TorchModel(net, cutoff=net.cutoff, layers=net.n_layers, per_layer=per_layer)
            results.append(compare(system, Pipeline([model])))
    return results
