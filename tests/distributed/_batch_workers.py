"""Batches on spawned ranks against one process (importable by child processes)."""

from __future__ import annotations

import torch

from halopipe import Batch, Ewald, Group, LennardJones, Pipeline, Step
from halopipe.distributed import DistributedError, DomainConfig, ShardedSystem

from ..test_batch import PIPELINES, demo_like, lj, mixed
from ._composite_workers import salt
from ._workers import rank


def batch_systems() -> list:
    """Two systems big enough to be split over the ranks (split_atoms=8 per rank) among small ones placed whole."""
    small = [s for s in mixed()]
    return [small[0], salt(seed=1).replace(fields={"charges": salt(seed=1).fields["charges"]}), *small[1:], salt((3, 3, 2), seed=2)]


def _message_passing():
    """The example network with per-layer halo refresh (torch's default init under a fixed seed: equal on every rank)."""
    from halopipe import TorchModel

    from ..models.test_adapter import MessagePassing

    torch.manual_seed(7)
    net = MessagePassing(cutoff=3.5, features=8, layers=3).double()
    return lambda: [TorchModel(net, cutoff=net.cutoff, layers=net.n_layers, per_layer=True), lj()]


def _groups(kind: str):
    if kind == "mlip_per_layer":
        return _message_passing()
    if kind == "ewald":
        return lambda: [Group([Step(demo_like()[1].steps[0].model), Step(Ewald(cutoff=6.0, accuracy=1e-8))]), lj()]
    return PIPELINES[kind]


def compare(kind: str, stress: bool, field_gradients=None) -> dict | None:
    """The largest deviation of the decomposed batch from one process per system (rank 0), by quantity."""
    systems = batch_systems()
    if kind in ("ewald", "d3_lattice") or stress:
        systems = [s for s in systems if bool(s.pbc.all()) and s.n_atoms > 1]
    config = DomainConfig(skin=0.3, timeout=60, split_atoms=8)
    out = Pipeline(_groups(kind)(), config=config)(systems if rank() == 0 else None, stress=stress, field_gradients=field_gradients)
    if rank() != 0:
        return None
    worst = {"force": 0.0, "energy_rel": 0.0, "stress": 0.0, "fields": 0.0, "gradient": 0.0}
    for system, one in zip(systems, Batch(systems).split(out)):
        alone = Pipeline(_groups(kind)(), config=config)(system, decompose=False, stress=stress, field_gradients=field_gradients)
        scale = max(1.0, abs(float(alone["energy"])))
        worst["energy_rel"] = max(worst["energy_rel"], abs(float(one["energy"] - alone["energy"])) / scale)
        for name, e in alone["model_energies"].items():
            worst["energy_rel"] = max(worst["energy_rel"], abs(float(one["model_energies"][name] - e)) / max(1.0, abs(float(e))))
        worst["force"] = max(worst["force"], float((one["forces"] - alone["forces"]).abs().max()) if system.n_atoms else 0.0)
        if stress:
            worst["stress"] = max(worst["stress"], float((one["stress"] - alone["stress"]).abs().max()) / scale)
        for name, value in alone["fields"].items():
            worst["fields"] = max(worst["fields"], float((one["fields"][name] - value).abs().max()) if system.n_atoms else 0.0)
        for key in [k for k in alone if k.startswith("d_energy_d_")]:
            worst["gradient"] = max(worst["gradient"], float((one[key] - alone[key]).abs().max()) if system.n_atoms else 0.0)
    worst["n_systems"] = len(systems)
    return worst


def all_cases() -> dict | None:
    cases = {
        "direct": compare("direct", stress=False),
        "wired": compare("wired", stress=False),
        "wired_stress": compare("wired", stress=True),
        "ewald_gradients": compare("ewald", stress=True, field_gradients=["charges"]),
        "d3_lattice": compare("d3_lattice", stress=True),
        "mlip_per_layer": compare("mlip_per_layer", stress=True),
    }
    return cases if rank() == 0 else None


def failing_species() -> str:
    """A system whose species a model lacks, placed whole on some rank: every rank raises the cause."""
    systems = batch_systems()
    bad = systems[1].numbers.clone()
    bad[0] = 118
    systems[1] = systems[1].replace(numbers=bad, masses=systems[1].masses)
    covered = (1, 6, 8, 11, 13, 14, 17, 29)  # every species of the batch but the 118 put in system 1
    model = LennardJones(epsilon=dict.fromkeys(covered, 0.01), sigma=2.5, cutoff=6.0)
    try:
        Pipeline([model], config=DomainConfig(skin=0.3, timeout=30, split_atoms=10_000))(systems if rank() == 0 else None)
    except DistributedError as error:
        return str(error)
    return "no error"


def failing_gather() -> str:
    """An exception on one rank inside ShardedSystem.gather (a wrongly shaped tensor) reaches its waiting peers."""
    sharded = ShardedSystem.scatter(salt() if rank() == 0 else None, DomainConfig(timeout=30))
    x = sharded.positions if rank() != 1 else torch.zeros(sharded.n_owned + 1, 2)
    try:
        sharded.gather(x)
    except DistributedError as error:
        return str(error)
    return "no error"


def empty_system() -> tuple:
    """A system of no atoms on every rank: gathered, evaluated alone and inside a batch."""
    empty = mixed()[-1]
    assert empty.n_atoms == 0
    config = DomainConfig(skin=0.3, timeout=30, split_atoms=8)
    sharded = ShardedSystem.scatter(empty if rank() == 0 else None, config)
    gathered = sharded.gather(sharded.positions)
    alone = Pipeline(demo_like(), config=config)(empty if rank() == 0 else None, stress=True)
    batch = Pipeline(demo_like(), config=config)([empty, salt(), empty] if rank() == 0 else None)
    return tuple(gathered.shape), float(alone["energy"]), tuple(alone["forces"].shape), batch["energy"][[0, 2]].tolist()
