"""Compiled models on spawned ranks against the eager model on one process (importable by child processes)."""

from __future__ import annotations

import torch

from halopipe import ChargeModel, Ewald, Group, Pipeline, Step, TorchModel
from halopipe.distributed import DomainConfig, ShardedSystem

from ._workers import _walk_step, make_system, rank


def _network():
    from ..models.test_adapter import MessagePassing

    return MessagePassing(cutoff=3.5, features=8, layers=3).double()


def _wired(net, compile: bool, config: DomainConfig) -> Pipeline:
    """Charges wired into Ewald, and a per-layer message-passing network, all in one autograd group."""
    steps = [
        Step(ChargeModel(3.5, coordination_weight=0.05)),
        Step(Ewald(cutoff=6.0, accuracy=1e-5)),
        Step(TorchModel(net, net.cutoff, layers=net.n_layers, per_layer=True)),
    ]
    return Pipeline([Group(steps, autograd=True)], config, compile=compile)


def compiled_wired_group(grid) -> dict | None:
    """A compiled network inside a wired group, split over the ranks, against the eager pipeline on one process."""
    system = make_system("triclinic")
    config = DomainConfig(grid=grid, timeout=300)
    net = _network()
    compiled = _wired(net, True, config)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    out = compiled(sharded, stress=True)
    forces = sharded.gather(out["forces"])
    compilations = int(sharded.all_reduce(torch.tensor([compiled.compilations]), "min")[0])
    if rank() != 0:
        return None
    ref = _wired(net, False, config)(system, stress=True, decompose=False)
    return {
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
        "force": float((forces - ref["forces"]).abs().max()),
        "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
        "compilations_min": compilations,
    }


def compiled_walk(steps: int, grid, skin: float) -> dict | None:
    """Evaluate a compiled network at every step of a random walk that rebuilds lists and migrates atoms.

    Returns the graphs compiled after the first evaluation and at the end (the busiest rank's), the
    rebuilds, and the final forces against the eager model on one process.
    """
    system = make_system("triclinic", seed=3)
    config = DomainConfig(grid=grid, skin=skin, timeout=300)
    net = _network()
    pipeline = Pipeline([TorchModel(net, net.cutoff, layers=net.n_layers, per_layer=True)], config, compile=True)
    sharded = ShardedSystem.scatter(system if rank() == 0 else None, config)
    first = None
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        sharded.positions = sharded.positions + _walk_step(g, system.n_atoms)[sharded.ids]
        out = pipeline(sharded, stress=True)
        first = pipeline.compilations if first is None else first
    counts = sharded.all_reduce(torch.tensor([first, pipeline.compilations]), "max")
    forces = sharded.gather(out["forces"])
    final = sharded.to_system()
    rebuilds = int(sharded.all_reduce(torch.tensor([sharded.rebuilds]), "min")[0])
    if rank() != 0:
        return None
    eager = Pipeline([TorchModel(net, net.cutoff, layers=net.n_layers, per_layer=True)])
    ref = eager(final, stress=True, decompose=False)
    return {
        "first": int(counts[0]),
        "last": int(counts[1]),
        "rebuilds": rebuilds,
        "force": float((forces - ref["forces"]).abs().max()),
        "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
    }
