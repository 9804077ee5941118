"""halopipe as a torch-sim model (halopipe.torch_sim), float64.

References: torch-sim's own interface check (``validate_model_outputs``),
halopipe's ASE calculator on each structure alone, torch-sim's own MACE wrapper
on the same mace-torch module, and finite differences of the wrapper's energy
for torch-sim's stress convention ``(1/V) dE/dε``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

ts = pytest.importorskip("torch_sim", reason="needs the [torchsim] extra (torch-sim-atomistic, Python >= 3.11)")
from ase import Atoms  # noqa: E402
from ase.build import bulk  # noqa: E402
from torch_sim.models.interface import validate_model_outputs  # noqa: E402

from halopipe import DFTD3, ChargeModel, DSFCoulomb, Ewald, Group, LennardJones, Pipeline, System  # noqa: E402
from halopipe.ase import Calculator  # noqa: E402
from halopipe.domain import DomainConfig  # noqa: E402
from halopipe.torch_sim import TorchSimModel  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

CPU, F64 = torch.device("cpu"), torch.float64
# Si, Na, Cl, Ar and Fe (torch-sim's interface check builds Si and Fe).
EPSILON = {11: 0.0115, 14: 0.0175, 17: 0.0043, 18: 0.0103, 26: 0.02}
SIGMA = {11: 2.0, 14: 2.2, 17: 3.4, 18: 3.4, 26: 2.3}


def composite() -> Pipeline:
    """LJ (direct) + charges wired into Ewald (autograd) + D3: no input fields needed."""
    return Pipeline(
        [
            LennardJones(EPSILON, SIGMA, cutoff=6.0),
            Group([ChargeModel(cutoff=4.0, electronegativity={18: 0.0}), Ewald(cutoff=6.0, accuracy=1e-6)]),
            DFTD3("pbe", cutoff=8.0, cn_cutoff=6.0),
        ],
        config=DomainConfig(skin=0.5),
    )


def structures() -> list[Atoms]:
    """Si (8 atoms), NaCl (64) and an Ar cluster (13) in a periodic box, each rattled and strained."""
    si = bulk("Si", "diamond", a=5.43, cubic=True)
    nacl = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(2)
    fcc = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(2)
    cluster = Atoms("Ar13", positions=fcc.positions[np.argsort(np.linalg.norm(fcc.positions - fcc.positions[13], axis=1))[:13]])
    cluster.set_cell(np.diag([13.0, 14.0, 15.0]))
    cluster.pbc = True
    out = []
    for seed, atoms in enumerate((si, nacl, cluster)):
        atoms.rattle(0.05, seed=seed)
        atoms.set_cell(atoms.cell.array @ (np.eye(3) + 0.01 * np.array([[1, 2, 0], [0, -1, 1], [1, 0, 2]])), scale_atoms=True)
        out.append(atoms)
    return out


def state_of(atoms: list[Atoms]):
    return ts.io.atoms_to_state(atoms, CPU, F64)


def test_torch_sim_interface_check_passes_for_a_composite():
    validate_model_outputs(TorchSimModel(composite()), CPU, F64)


def test_batched_state_matches_the_ase_calculator_per_structure():
    atoms = structures()
    model, state = TorchSimModel(composite()), state_of(atoms)
    out = model(state)
    as_dict = model({name: getattr(state, name) for name in ("positions", "cell", "pbc", "atomic_numbers", "system_idx")})
    for key in ("energy", "forces", "stress"):
        assert torch.equal(as_dict[key], out[key])
    assert out["energy"].shape == (3,) and out["forces"].shape == (sum(map(len, atoms)), 3) and out["stress"].shape == (3, 3, 3)
    assert out["energy"].dtype == F64
    start = 0
    for b, structure in enumerate(atoms):
        structure.calc = Calculator(composite())
        n = len(structure)
        assert abs(float(out["energy"][b]) - structure.get_potential_energy()) < 1e-10
        np.testing.assert_allclose(out["forces"][start : start + n].numpy(), structure.get_forces(), rtol=0, atol=1e-10)
        # Stress from the pipeline the calculator wraps: halopipe.ase passes ASE 3.29's numpy bool (cell.rank == 3) as
        # stress=, which an autograd group's torch.zeros(requires_grad=...) rejects.
        stress = composite()(System.from_ase(structure), stress=True)["stress"]
        np.testing.assert_allclose(out["stress"][b].numpy(), stress.numpy(), rtol=0, atol=1e-10)
        start += n


def test_a_float32_state_is_evaluated_in_float32():
    # DSF in place of Ewald: torch 2.13's det backward fails on float32 under a float64 default dtype (conftest.py's).
    def dsf_composite() -> Pipeline:
        charges = Group([ChargeModel(cutoff=4.0, electronegativity={18: 0.0}), DSFCoulomb(cutoff=6.0)])
        return Pipeline([LennardJones(EPSILON, SIGMA, cutoff=6.0), charges, DFTD3("pbe", cutoff=8.0, cn_cutoff=6.0)])

    atoms = structures()
    expected = TorchSimModel(dsf_composite())(state_of(atoms))
    out = TorchSimModel(dsf_composite(), dtype=torch.float32)(ts.io.atoms_to_state(atoms, CPU, torch.float32))
    for key in ("energy", "forces", "stress"):
        assert out[key].dtype == torch.float32
        scale = float(expected[key].abs().max())
        np.testing.assert_allclose(out[key].double().numpy(), expected[key].numpy(), rtol=0, atol=1e-5 * scale, err_msg=key)


def evaluate_on_ranks() -> dict[str, np.ndarray]:
    """The wrapper on the batch of :func:`structures`, called on every rank of a process group (for spawn)."""
    out = TorchSimModel(composite())(state_of(structures()))
    return {key: value.numpy() for key, value in out.items()}


def test_under_a_process_group_each_system_is_split_over_the_ranks():
    from halopipe.distributed.launch import spawn

    expected = TorchSimModel(composite())(state_of(structures()))
    for out in spawn(evaluate_on_ranks, 2, timeout=180):
        for key in ("energy", "forces", "stress"):
            np.testing.assert_allclose(out[key], expected[key].numpy(), rtol=0, atol=1e-10, err_msg=key)


def test_stress_is_torch_sims_convention():
    """torch-sim's stress is (1/V) dE/dε (torch_sim.quantities.get_pressure): check against central differences."""
    atoms = structures()[0]
    model = TorchSimModel(composite())
    stress = model(state_of([atoms]))["stress"][0]
    h = 1e-5
    for i, j in [(0, 0), (1, 2), (2, 1)]:
        energies = []
        for sign in (1, -1):
            strained = atoms.copy()
            strain = np.eye(3)
            strain[i, j] += sign * h
            strained.set_cell(atoms.cell.array @ strain, scale_atoms=True)  # row vectors: r' = r (1 + ε)
            energies.append(float(model(state_of([strained]))["energy"][0]))
        expected = (energies[0] - energies[1]) / (2 * h) / atoms.get_volume()
        assert abs(float(stress[i, j]) - expected) < 1e-7, (i, j)


def test_fields_a_state_cannot_carry_are_named_or_given():
    needs_charges = Pipeline([DSFCoulomb(cutoff=6.0)])
    with pytest.raises(ValueError, match=r"\['charges'\]"):
        TorchSimModel(needs_charges)
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    atoms.rattle(0.05, seed=3)
    reference = atoms.copy()
    reference.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
    reference.calc = Calculator(Pipeline([DSFCoulomb(cutoff=6.0)]))
    by_species = TorchSimModel(needs_charges, fields={"charges": {11: 1.0, 17: -1.0}})(state_of([atoms]))
    by_callable = TorchSimModel(needs_charges, fields=lambda s: {"charges": 2.0 * (s.numbers == 11) - 1.0})(state_of([atoms]))
    for out in (by_species, by_callable):
        assert abs(float(out["energy"][0]) - reference.get_potential_energy()) < 1e-10
        np.testing.assert_allclose(out["forces"].numpy(), reference.get_forces(), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="no value for atomic number 17"):
        TorchSimModel(needs_charges, fields={"charges": {11: 1.0}})(state_of([atoms]))


def test_nvt_langevin_run_on_a_batch():
    """A few Langevin steps of two structures at once; the final state's forces are halopipe's on its positions."""
    atoms = structures()[::2]  # Si and the Ar cluster
    model = TorchSimModel(composite())
    final = ts.integrate(state_of(atoms), model, integrator=ts.nvt_langevin, n_steps=5, temperature=300.0, timestep=0.001, seed=1)
    start = 0
    for b, structure in enumerate(atoms):
        n = len(structure)
        moved = structure.copy()
        moved.positions = final.positions[start : start + n].numpy()
        assert np.abs(moved.positions - structure.positions).max() > 1e-4
        moved.calc = Calculator(composite())
        np.testing.assert_allclose(final.forces[start : start + n].numpy(), moved.get_forces(), rtol=0, atol=1e-10)
        assert abs(float(final.energy[b]) - moved.get_potential_energy()) < 1e-10
        start += n
    assert torch.isfinite(ts.calc_kT(masses=final.masses, momenta=final.momenta, system_idx=final.system_idx)).all()


@pytest.mark.timeout(60)  # a wrong stress sign drives the cells away instead of failing fast
def test_batched_fire_relaxation_lowers_energy_and_forces():
    """Positions and cells of two strained, rattled argon crystals relaxed at once (the cell moves by the stress)."""
    crystals = []
    for seed, (n, strain) in enumerate([(2, 0.04), (1, -0.03)]):
        atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(n)
        atoms.rattle(0.05, seed=seed)
        atoms.set_cell(atoms.cell.array * (1 + strain), scale_atoms=True)
        crystals.append(atoms)
    model = TorchSimModel(Pipeline([LennardJones(0.0103, 3.4, cutoff=6.0)], config=DomainConfig(skin=0.5)))
    start = model(state_of(crystals))
    tolerance = 1e-3
    final = ts.optimize(
        state_of(crystals),
        model,
        optimizer=ts.frechet_cell_fire,
        convergence_fn=ts.generate_force_convergence_fn(force_tol=tolerance, include_cell_forces=True),
        max_steps=200,
    )
    end = model(final)
    assert (end["energy"] < start["energy"] - 1e-3).all()
    fmax = torch.stack([end["forces"][final.system_idx == b].norm(dim=1).max() for b in range(2)])
    assert (fmax < tolerance).all()
    assert end["stress"].abs().max() < 1e-3  # eV/Å³: the cells relaxed to zero stress too


def small_mace(species=(14, 26)) -> torch.nn.Module:
    """A small mace-torch model with random weights (as tests/models/test_mace.py builds them), float64."""
    pytest.importorskip("mace")  # mace before e3nn: it lets e3nn 0.4.4 load its constants under torch >= 2.6
    from e3nn import o3
    from mace import modules

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(11)
        model = modules.ScaleShiftMACE(
            r_max=3.0,
            num_bessel=6,
            num_polynomial_cutoff=5,
            max_ell=2,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            num_interactions=2,
            num_elements=len(species),
            hidden_irreps=o3.Irreps("8x0e+8x1o"),
            MLP_irreps=o3.Irreps("8x0e"),
            atomic_energies=np.array([-1.1, -2.3]),
            avg_num_neighbors=8.0,
            atomic_numbers=list(species),
            correlation=2,
            gate=torch.nn.functional.silu,
            radial_MLP=[8, 8],
            atomic_inter_scale=1.3,
            atomic_inter_shift=-0.2,
        )
        with torch.no_grad():  # default init gives tiny interaction energies; make them O(1)
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(old)
    return model.double()


def test_torch_sim_interface_check_passes_for_mace():
    from halopipe import MACE

    validate_model_outputs(TorchSimModel(MACE(small_mace())), CPU, F64)


def test_mace_matches_torch_sims_own_mace_wrapper():
    """Two Si and one Fe structure in one state: halopipe.MACE through the wrapper against torch_sim.models.mace.MaceModel."""
    from torch_sim.models.mace import MaceModel

    from halopipe import MACE

    atoms = [bulk("Si", "diamond", a=5.43, cubic=True), bulk("Fe", "bcc", a=2.87, cubic=True).repeat(2), bulk("Si", "diamond", a=5.43)]
    for seed, structure in enumerate(atoms):
        structure.rattle(0.05, seed=seed)
        structure.set_cell(structure.cell.array @ (np.eye(3) + 0.01 * np.array([[1, 2, 0], [0, -1, 1], [1, 0, 2]])), scale_atoms=True)
    module = small_mace()
    ours = TorchSimModel(MACE(copy.deepcopy(module)))(state_of(atoms))
    reference = MaceModel(copy.deepcopy(module), device=CPU, dtype=F64)(state_of(atoms))
    for key in ("energy", "forces", "stress"):
        np.testing.assert_allclose(ours[key].numpy(), reference[key].numpy(), rtol=0, atol=1e-10, err_msg=key)


def test_importing_halopipe_does_not_import_torch_sim_and_a_missing_torch_sim_is_named():
    code = (
        "import sys, halopipe; halopipe.Pipeline; assert 'torch_sim' not in sys.modules\n"
        "sys.modules['torch_sim'] = None  # as if not installed\n"
        "try:\n    import halopipe.torch_sim\nexcept ImportError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert 'pip install "halopipe[torchsim]"' in result.stdout
