"""Bring-your-own-model adapter against a direct periodic-graph evaluation.

The reference evaluates the example network (examples/message_passing.py) on
the periodic graph of the N atoms themselves (ASE neighbour list with image
shifts, no ghost rows), with forces and stress by autograd through the pair
vectors and a strain. The adapter, in per-layer (refreshed halo) and wide-halo
mode, must reproduce it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ase = pytest.importorskip("ase")
from ase.build import bulk
from ase.neighborlist import neighbor_list

from halopipe import LennardJones
from halopipe.models.adapter import TorchModel
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System
from halopipe.testing import check_model

pytestmark = pytest.mark.timeout(120)


def _load_example():
    path = Path(__file__).resolve().parents[2] / "examples" / "message_passing.py"
    spec = importlib.util.spec_from_file_location("message_passing_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importable by name, as torch.compile's tracing needs
    spec.loader.exec_module(module)
    return module


MessagePassing = _load_example().MessagePassing


def make_atoms(kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    if kind == "diamond":  # small cubic cell: cutoff * layers spans several images
        atoms = bulk("Si", "diamond", a=5.43, cubic=True)
        atoms.rattle(0.1, seed=seed)
        return atoms
    cell = np.array([[6.5, 0.0, 0.0], [1.1, 6.8, 0.0], [-0.7, 0.8, 6.6]])
    grid = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), -1).reshape(-1, 3) / 3
    frac = grid + rng.uniform(-0.06, 0.06, grid.shape)
    atoms = ase.Atoms(numbers=rng.choice([1, 6, 8], len(frac)), scaled_positions=frac, cell=cell, pbc=kind == "triclinic")
    if kind == "cluster":
        atoms.cell[:] = 0.0
    return atoms


def reference(net: MessagePassing, atoms, cutoff: float) -> dict:
    """Energy, forces and stress of the network on the periodic graph of the atoms."""
    i, j, shifts = neighbor_list("ijS", atoms, cutoff)
    pos = torch.tensor(atoms.positions, dtype=torch.float64, requires_grad=True)
    cell = torch.tensor(atoms.cell.array, dtype=torch.float64)
    strain = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    deform = torch.eye(3, dtype=torch.float64) + strain
    i, j = torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)
    vectors = (pos[j] + torch.as_tensor(shifts, dtype=torch.float64) @ cell - pos[i]) @ deform
    numbers = torch.as_tensor(atoms.numbers, dtype=torch.int64)
    energy = net(numbers, torch.stack([i, j]), vectors, len(atoms)).sum()
    grad_pos, grad_strain = torch.autograd.grad(energy, [pos, strain])
    out = {"energy": float(energy.detach()), "forces": -grad_pos.numpy()}
    if atoms.pbc.all():
        out["stress"] = grad_strain.numpy() / atoms.get_volume()
    return out


def run(model: TorchModel, atoms) -> dict:
    periodic = bool(atoms.pbc.all())
    out = Pipeline([Group([Step(model)], autograd=True)])(System.from_ase(atoms), stress=periodic)
    return {k: out[k].detach().numpy() for k in ("energy", "forces", "stress") if k in out}


@pytest.mark.parametrize("kind", ["diamond", "triclinic", "cluster"])
@pytest.mark.parametrize("layers", [1, 3])
def test_matches_direct_periodic_evaluation(kind, layers):
    cutoff = 3.0
    net = MessagePassing(cutoff=cutoff, layers=layers, seed=layers).double()
    atoms = make_atoms(kind)
    ref = reference(net, atoms, cutoff)
    for per_layer in (True, False):
        got = run(TorchModel(net, cutoff, layers=layers, per_layer=per_layer), atoms)
        label = f"per_layer={per_layer}"
        assert abs(got["energy"] - ref["energy"]) <= 1e-10 * abs(ref["energy"]), label
        np.testing.assert_allclose(got["forces"], ref["forces"], rtol=0, atol=1e-9, err_msg=label)
        if "stress" in ref:
            np.testing.assert_allclose(got["stress"], ref["stress"], rtol=0, atol=1e-9, err_msg=label)


def test_halo_widths():
    net = MessagePassing(cutoff=2.5, layers=3)
    assert TorchModel(net, 2.5, layers=3, per_layer=True).halo == pytest.approx(2.5)
    assert TorchModel(net, 2.5, layers=3).halo == pytest.approx(7.5)
    assert TorchModel(net, 2.5).halo == pytest.approx(2.5)


def test_plain_module_without_hooks():
    """A module with only forward() runs in wide mode and agrees with the hooked path."""
    net = MessagePassing(cutoff=3.0, layers=2, seed=3).double()

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, numbers, pairs, vectors, n_nodes):
            return self.net(numbers, pairs, vectors, n_nodes)

    atoms = make_atoms("triclinic")
    wide = run(TorchModel(Plain(), 3.0, layers=2), atoms)
    hooked = run(TorchModel(net, 3.0, layers=2, per_layer=True), atoms)
    assert wide["energy"] == pytest.approx(hooked["energy"], rel=1e-12)
    with pytest.raises(ValueError, match="lacks"):
        TorchModel(Plain(), 3.0, layers=2, per_layer=True)


def test_bad_input():
    net = MessagePassing()
    with pytest.raises(ValueError, match="cutoff"):
        TorchModel(net, 0.0)
    with pytest.raises(ValueError, match="layers"):
        TorchModel(net, 3.0, layers=0)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        TorchModel(lambda *a: None, 3.0)

    class Wrong(torch.nn.Module):
        def forward(self, numbers, pairs, vectors, n_nodes):
            return vectors.new_zeros(n_nodes, 1)

    with pytest.raises(ValueError, match="shape"):
        run(TorchModel(Wrong(), 3.0), make_atoms("triclinic"))


def test_check_model():
    net = MessagePassing(cutoff=3.0, layers=3, seed=5).double()
    check_model(TorchModel(net, 3.0, layers=3, per_layer=True), System.from_ase(make_atoms("diamond")))


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("per_layer", [True, False])
def test_compiled_equals_the_reference_and_new_sizes_do_not_recompile(per_layer):
    """``compile=True`` through the pipeline: the same numbers as the periodic reference, one set of graphs."""
    cutoff, layers = 3.0, 2
    net = MessagePassing(cutoff=cutoff, layers=layers, seed=7).double()
    model = TorchModel(net, cutoff, layers=layers, per_layer=per_layer)
    pipeline = Pipeline([Group([Step(model)], autograd=True)], compile=True)
    counts = []
    for repeat, seed in ((1, 0), (2, 1), (1, 2)):
        atoms = make_atoms("triclinic", seed).repeat((repeat, 1, 1))
        ref = reference(net, atoms, cutoff)
        out = pipeline(System.from_ase(atoms), stress=True)
        assert float(out["energy"]) == pytest.approx(ref["energy"], rel=1e-12)
        np.testing.assert_allclose(out["forces"].detach().numpy(), ref["forces"], rtol=0, atol=1e-10)
        np.testing.assert_allclose(out["stress"].detach().numpy(), ref["stress"], rtol=0, atol=1e-12)
        counts.append(pipeline.compilations)
    assert model.stages.failure is None and counts[0] > 0
    assert counts[0] == counts[1] == counts[2], counts  # 27 -> 54 -> 27 atoms: other row and pair counts, no recompile


def test_compile_options_are_checked():
    net = MessagePassing()
    with pytest.raises(ValueError, match="none of the models .*LennardJones.* has compiled stages"):
        Pipeline([LennardJones(0.01, 3.0, cutoff=5.0)], compile=True)
    with pytest.raises(ValueError, match="compile_kwargs were given without compile=True"):
        Pipeline([TorchModel(net, 3.0)], compile_kwargs={"mode": "max-autotune"})
    with pytest.raises(ValueError, match="compile_kwargs were given without compile=True"):
        TorchModel(net, 3.0, compile_kwargs={"dynamic": False})
    with pytest.raises(ValueError, match=r"\['backend'\] are not supported"):
        Pipeline([TorchModel(net, 3.0)], compile=True, compile_kwargs={"backend": "eager"})
    own = TorchModel(net, 3.0, compile=True, compile_kwargs={"dynamic": False})
    Pipeline([own, TorchModel(net, 3.0)], compile=True)
    assert own.stages.options == {"dynamic": False}  # a model compiled with its own options keeps them
