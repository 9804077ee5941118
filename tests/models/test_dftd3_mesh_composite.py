"""D3(BJ) by particle mesh in composites, one process (float64).

Reference: the parts evaluated separately, each in a pipeline of its own, summed. The composites:

* an MLIP (a small random-weight mace-torch MACE, H/C/O, as in ``test_mace.py``) and
  :class:`~halopipe.models.dftd3_mesh.DFTD3Mesh` in one autograd group (one backward pass for both);
* a charge model wired into PME plus DFTD3Mesh in one autograd group, both on a mesh of the same shape.

Energy to 1e-12 relative, forces to 1e-10 eV/Å, stress to 1e-12 relative to its largest component;
the per-step ``model_energies`` must be the parts' own energies. The same composites on two ranks are in
``tests/distributed/test_dftd3_mesh_composite_distributed.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk

from halopipe import PME, ChargeModel, Group, Pipeline, Step, System
from halopipe.models.dftd3_mesh import DFTD3Mesh

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

MESH = (20, 20, 20)  # PME's and D3's mesh shape in the PME composite (one FFT plan per shape under ranks)


def salt(seed: int = 0) -> System:
    """64 rattled Na/Cl in a sheared cell (11.3 Å), with initial charges."""
    atoms = bulk("NaCl", "rocksalt", a=5.64).repeat((2, 2, 2))
    rng = np.random.default_rng(seed)
    atoms.positions += rng.normal(scale=0.12, size=atoms.positions.shape)
    atoms.set_cell(atoms.cell.array + np.array([[0, 0.3, 0.2], [0.5, 0, 0.1], [0.1, 0.6, 0]]), scale_atoms=True)
    atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    return System.from_ase(atoms)


def charges_pme_steps() -> list[Step]:
    return [Step(ChargeModel(3.5, coordination_weight=0.05)), Step(PME(cutoff=5.0, mesh_size=MESH, order=5, mesh="distributed"))]


def mesh_d3(**kwargs) -> DFTD3Mesh:
    return DFTD3Mesh("pbe", cn_cutoff=10.0, **{"mesh_size": MESH, "order": 5, **kwargs})


def mlip_system() -> System:
    from .test_mace import make_atoms

    return System.from_ase(make_atoms(True, n_side=3, seed=1))  # 27 H/C/O in a 7 Å triclinic cell


def mlip_steps() -> list[Step]:
    from halopipe import MACE

    from .test_mace import build_model

    return [Step(MACE(build_model("scaleshift_L2_corr3")), name="mlip")]


def composites() -> dict:
    """name -> (system, the composite's groups, the parts' groups (each evaluated alone))."""
    return {
        "mlip_d3": (mlip_system, lambda: [Group(mlip_steps() + [Step(DFTD3Mesh("pbe", cn_cutoff=10.0), name="d3")], autograd=True)]),
        "pme_d3": (salt, lambda: [Group(charges_pme_steps() + [Step(mesh_d3(), name="d3")], autograd=True)]),
    }


def parts(name: str) -> list[list[Group]]:
    if name == "mlip_d3":
        return [[Group(mlip_steps(), autograd=True)], [Group([Step(DFTD3Mesh("pbe", cn_cutoff=10.0), name="d3")], autograd=True)]]
    return [[Group(charges_pme_steps(), autograd=True)], [Group([Step(mesh_d3(), name="d3")], autograd=True)]]


def sum_of_parts(name: str, system: System) -> dict:
    """The parts evaluated separately on this process, summed; ``model_energies`` by step name."""
    total = {"energy": 0.0, "forces": 0.0, "stress": 0.0, "model_energies": {}}
    for groups in parts(name):
        pipeline = Pipeline(groups)
        out = pipeline(system, stress=True, decompose=False)
        for key in ("energy", "forces", "stress"):
            total[key] = total[key] + out[key].detach()
        total["model_energies"].update({k: float(v) for k, v in out["model_energies"].items()})
    return total


def differences(out: dict, ref: dict) -> dict:
    return {
        "energy_rel": abs(float(out["energy"]) - float(ref["energy"])) / abs(float(ref["energy"])),
        "force": float((out["forces"] - ref["forces"]).abs().max()),
        "stress_rel": float((out["stress"] - ref["stress"]).abs().max() / ref["stress"].abs().max()),
        "largest_force": float(ref["forces"].abs().max()),
        "model_energies": {k: (float(v), ref["model_energies"][k]) for k, v in out["model_energies"].items()},
    }


def check(d: dict) -> None:
    assert d["energy_rel"] <= 1e-12, d
    assert d["force"] <= 1e-10, d
    assert d["stress_rel"] <= 1e-12, d
    assert d["largest_force"] > 1e-3, d
    assert len(d["model_energies"]) >= 2 and "d3" in d["model_energies"], d
    for mine, theirs in d["model_energies"].values():
        assert abs(mine - theirs) <= 1e-12 * max(1.0, abs(theirs)), d


@pytest.mark.parametrize("name", ["mlip_d3", "pme_d3"])
def test_composite_equals_the_sum_of_its_parts(name: str) -> None:
    if name == "mlip_d3":
        pytest.importorskip("mace")
    make_system, groups = composites()[name]
    system = make_system()
    pipeline = Pipeline(groups())
    check(differences(pipeline(system, stress=True), sum_of_parts(name, system)))
    # The same pipeline again (an MD step): kernels and decompositions cached from the first call give the same result.
    again = pipeline(system, stress=True)
    check(differences(again, sum_of_parts(name, system)))


def test_charge_gradient_of_the_pme_composite_is_pme_s_alone() -> None:
    """``d_energy_d_charges`` of the wired charges: PME's downstream partial, which D3 (no charge input) leaves alone."""
    system = salt()
    out = Pipeline(composites()["pme_d3"][1]())(system, stress=True, field_gradients=["charges"])
    ref = Pipeline(parts("pme_d3")[0])(system, stress=True, field_gradients=["charges"])
    assert torch.equal(out["fields"]["charges"], ref["fields"]["charges"])
    assert float(ref["d_energy_d_charges"].abs().max()) > 1e-2
    assert float((out["d_energy_d_charges"] - ref["d_energy_d_charges"]).abs().max()) <= 1e-10
