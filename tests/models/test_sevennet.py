"""SevenNet wrapper against sevenn's own ASE calculator (single process).

The checkpoints ship in the sevenn wheel (no downloads). The reference is
``sevenn.calculator.SevenNetCalculator``: sevenn builds its own periodic graph,
runs the whole ``AtomGraphSequential`` and differentiates with respect to its
edge vectors for forces and stress. For float64 the same checkpoint is cast and
the calculator's graph is built in float64 (sevenn's calculator hard-codes
float32 inputs). These tests run in the ``sevenn`` nox session (sevenn needs
e3nn >= 0.5, mace-torch 0.3.16 pins 0.4.4) and are skipped only where sevenn
is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

sevenn = pytest.importorskip("sevenn")
from ase import Atoms, units
from ase.build import bulk, molecule
from ase.calculators.calculator import Calculator
from dftd3.interface import DispersionModel, RationalDampingParam
from sevenn.atom_graph_data import AtomGraphData
from sevenn.calculator import SevenNetCalculator
from sevenn.train.dataload import unlabeled_atoms_to_graph
from sevenn.util import dtype_correct

from halopipe import DFTD3, Group, Pipeline, SevenNet, Step, System
from halopipe.models.sevennet import load_sevennet
from halopipe.testing import check_model

pytestmark = [
    pytest.mark.sevenn,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

# Measured float32 agreement with SevenNetCalculator in float32 (both single precision, different summation order):
# relative energy <= 1.1e-7, forces <= 1.2e-6 eV/Å, stress <= 1.4e-8 eV/Å³ on the three systems. Bounds with margin:
F32_ENERGY_REL, F32_FORCE, F32_STRESS = 1e-6, 1e-5, 1e-7


# ------------------------------------------------------------------------------------------ systems
def triclinic_crystal(repeat=(2, 2, 2), seed: int = 0) -> Atoms:
    """Rattled rock-salt NaCl in a sheared (triclinic) cell."""
    atoms = bulk("NaCl", "rocksalt", a=5.64).repeat(repeat)
    atoms.rattle(0.1, seed=seed)
    atoms.set_cell(atoms.cell.array + np.array([[0, 0.3, 0.2], [0.5, 0, 0], [0.1, 0.7, 0]]), scale_atoms=True)
    return atoms


def molecule_system() -> Atoms:
    """Ethanol, rattled, no periodicity."""
    atoms = molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=1)
    return atoms


def multi_element_cell() -> Atoms:
    """A 2x2x2 perovskite SrTiO3 with Ba on two A sites and F on one O site (five elements), rattled, slightly sheared."""
    a = 3.905
    frac = [[0, 0, 0], [0.5, 0.5, 0.5], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]]
    atoms = Atoms("SrTiO3", scaled_positions=frac, cell=np.eye(3) * a, pbc=True).repeat((2, 2, 2))
    numbers = atoms.numbers.copy()
    numbers[[0, 10]] = 56  # Ba
    numbers[2] = 9  # F
    atoms.numbers = numbers
    atoms.rattle(0.08, seed=2)
    atoms.set_cell(atoms.cell.array + np.array([[0, 0.2, 0.1], [0.3, 0, 0], [0.0, 0.25, 0]]), scale_atoms=True)
    return atoms


SYSTEMS = {"triclinic_crystal": triclinic_crystal, "molecule": molecule_system, "multi_element": multi_element_cell}


# ---------------------------------------------------------------------------------------- reference
class _CalculatorInDtype(SevenNetCalculator):
    """sevenn's calculator with its graph built in the model's dtype (its own builds float32 inputs)."""

    def __init__(self, model, dtype: torch.dtype, modal: str | None = None) -> None:
        super().__init__(model, file_type="model_instance", device="cpu", modal=modal)
        self.float_dtype = dtype

    def calculate(self, atoms=None, properties=None, system_changes=None):
        Calculator.calculate(self, atoms, properties, system_changes)
        graph = unlabeled_atoms_to_graph(atoms, self.cutoff)
        data = AtomGraphData(**{k: dtype_correct(v, self.float_dtype) for k, v in graph.items()})
        if self.modal:
            data["data_modality"] = self.modal
        self.results = self.output_to_results(self.model(data))


def _cast_one_hot(module, inputs, output):
    """sevenn's one-hot embedding is float32; a float64 model needs it cast (as halopipe does)."""
    return {k: (v.double() if torch.is_tensor(v) and v.dtype == torch.float32 else v) for k, v in output.items()}


def reference_calculator(name: str = "7net-0", dtype: torch.dtype = torch.float64, modal: str | None = None) -> SevenNetCalculator:
    module = load_sevennet(name).to(dtype)
    if dtype == torch.float64:
        for sub in module._modules.values():
            if type(sub).__name__ == "OnehotEmbedding":
                sub.register_forward_hook(_cast_one_hot)
        return _CalculatorInDtype(module, dtype, modal)
    return SevenNetCalculator(module, file_type="model_instance", device="cpu", modal=modal)


def reference(calc: SevenNetCalculator, atoms: Atoms) -> dict:
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(), "energies": calc.results["energies"]}
    if atoms.pbc.all():
        out["stress"] = atoms.get_stress(voigt=False)
    return out


def ours(model, atoms: Atoms) -> dict:
    out = Pipeline([Group([Step(model)], autograd=True)])(System.from_ase(atoms), stress=bool(atoms.pbc.all()))
    return {k: out[k].detach().numpy() for k in ("energy", "forces", "stress") if k in out}


@pytest.fixture(scope="module")
def calc64():
    return reference_calculator(dtype=torch.float64)


@pytest.fixture(scope="module")
def model64():
    return SevenNet("7net-0", dtype="float64")


def assert_matches(got: dict, ref: dict, energy_rel: float, force: float, stress: float) -> None:
    assert abs(float(got["energy"]) - ref["energy"]) <= energy_rel * abs(ref["energy"]), (float(got["energy"]), ref["energy"])
    np.testing.assert_allclose(got["forces"], ref["forces"], rtol=0, atol=force)
    if "stress" in ref:
        np.testing.assert_allclose(got["stress"], ref["stress"], rtol=0, atol=stress)


# -------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_float64_matches_sevenn_calculator(name, calc64, model64):
    atoms = SYSTEMS[name]()
    ref = reference(calc64, atoms)
    assert np.abs(ref["forces"]).max() > 0.1  # a non-trivial configuration
    assert_matches(ours(model64, atoms), ref, energy_rel=1e-9, force=1e-8, stress=1e-9)


@pytest.mark.parametrize("name", sorted(SYSTEMS))
def test_float32_matches_sevenn_calculator(name):
    atoms = SYSTEMS[name]()
    ref = reference(reference_calculator(dtype=torch.float32), atoms)
    assert_matches(ours(SevenNet("7net-0"), atoms), ref, F32_ENERGY_REL, F32_FORCE, F32_STRESS)


def test_wide_halo_matches_sevenn_calculator(calc64):
    """The wide halo (5 layers x 5 Å) on the molecule: every row is a centre, no refresh."""
    atoms = molecule_system()
    wide = SevenNet("7net-0", halo_mode="wide", dtype="float64")
    assert_matches(ours(wide, atoms), reference(calc64, atoms), energy_rel=1e-9, force=1e-8, stress=1e-9)


def test_per_atom_energies_match_sevenn(calc64, model64):
    atoms = triclinic_crystal()
    ref = reference(calc64, atoms)

    class Recording(SevenNet):
        def forward(self, view, direct=False):
            out = super().forward(view, direct)
            self.seen = (view.ids[: view.n_owned], out.energies.detach())
            return out

    recording = Recording(model64.module)
    ours(recording, atoms)
    ids, values = recording.seen
    energies = torch.zeros(len(atoms), dtype=torch.float64).index_add(0, ids, values).numpy()
    np.testing.assert_allclose(energies, ref["energies"], rtol=0, atol=1e-10)


def test_multi_fidelity_model_with_modal():
    atoms = multi_element_cell()
    for modal in ("R2SCAN",):
        ref = reference(reference_calculator("7net-mf-0", torch.float64, modal=modal), atoms)
        assert_matches(ours(SevenNet("7net-mf-0", modal=modal.lower(), dtype="float64"), atoms), ref, 1e-9, 1e-8, 1e-9)


def test_conformance(model64):
    """Finite differences, invariances and net force (halopipe.testing.check_model)."""
    check_model(model64, System.from_ase(triclinic_crystal(repeat=(1, 1, 2))), n_fd_atoms=2, force_atol=1e-6, stress_atol=1e-7)
    check_model(model64, System.from_ase(molecule_system()), n_fd_atoms=2, force_atol=1e-6)


def test_sevennet_plus_d3_matches_calculator_plus_sdftd3(calc64, model64):
    """SevenNet-0 + DFTD3(PBE, BJ) as one autograd group against sevenn's calculator + s-dftd3, summed."""
    cutoff, cn_cutoff = 12.0, 8.0
    pipeline = Pipeline([Group([Step(model64), Step(DFTD3("pbe", "bj", cutoff=cutoff, cn_cutoff=cn_cutoff))], autograd=True)])
    for atoms in (triclinic_crystal(), multi_element_cell()):
        got = pipeline(System.from_ase(atoms), stress=True)
        mlip = reference(calc64, atoms)
        disp = DispersionModel(atoms.numbers, atoms.positions / units.Bohr, atoms.cell.array / units.Bohr, np.array([True] * 3))
        disp.set_realspace_cutoff(cutoff / units.Bohr, cutoff / units.Bohr, cn_cutoff / units.Bohr)
        d3 = disp.get_dispersion(RationalDampingParam(method="pbe", atm=False), grad=True)
        energy = mlip["energy"] + float(d3["energy"]) * units.Hartree
        forces = mlip["forces"] - np.asarray(d3["gradient"]) * units.Hartree / units.Bohr
        stress = mlip["stress"] + np.asarray(d3["virial"]) * units.Hartree / atoms.get_volume()
        assert abs(float(d3["energy"])) * units.Hartree > 0.1  # dispersion is not negligible here
        assert abs(float(got["energy"]) - energy) <= 1e-9 * abs(energy)
        np.testing.assert_allclose(got["forces"].numpy(), forces, rtol=0, atol=1e-8)
        np.testing.assert_allclose(got["stress"].numpy(), stress, rtol=0, atol=1e-9)


def test_halo_widths(model64):
    assert model64.cutoff == pytest.approx(5.0) and model64.num_layers == 5
    assert model64.halo == pytest.approx(5.0)
    assert SevenNet(model64.module, halo_mode="wide").halo == pytest.approx(25.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"model": "7net-nonexistent"}, "model='7net-nonexistent' is neither a checkpoint file nor a pretrained name"),
        ({"model": "/no/such/checkpoint.pth"}, "model='/no/such/checkpoint.pth'"),
        ({"halo_mode": "layers"}, "halo_mode must be one of"),
        ({"modal": "PBE"}, "single fidelity; remove modal"),
        ({"model": "7net-mf-0"}, r"needs modal= one of \['PBE', 'R2SCAN'\]"),
        ({"dtype": "float16"}, "dtype must be one of"),
    ],
)
def test_bad_arguments_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SevenNet(**kwargs)


def test_unknown_element_is_named(model64):
    atoms = Atoms("Og2", positions=[[0, 0, 0], [0, 0, 2.5]])
    with pytest.raises(ValueError, match=r"element\(s\) \[118\] are not known"):
        ours(model64, atoms)


@pytest.mark.timeout(900)
def test_compiled_matches_sevenn_calculator_without_recompiling(calc64, float32_default):
    """``compile=True``: the checkpoint's modules under torch.compile give sevenn's numbers; a second size adds no graph.

    Compiled under torch's float32 default, as a user's script runs it: a compiled float64 MACE once lost precision
    that way (tests/models/test_mace_compile.py); SevenNet-0 measured 2e-16 relative from eager float64 there.
    """
    model = SevenNet("7net-0", dtype="float64", compile=True)
    counts = []
    for name in ("triclinic_crystal", "multi_element"):  # 16 and 40 atoms, different elements, edges and ghosts
        atoms = SYSTEMS[name]()
        assert_matches(ours(model, atoms), reference(calc64, atoms), energy_rel=1e-9, force=1e-8, stress=1e-9)
        counts.append(model.stages.compilations)
    assert model.stages.failure is None and counts[0] > 0
    assert counts[1] == counts[0], counts


def test_checkpointed_layers_match_sevenn_calculator(calc64):
    """``checkpoint=True`` recomputes each layer in the backward pass: the same forces and stress."""
    atoms = triclinic_crystal()
    model = SevenNet("7net-0", dtype="float64", checkpoint=True)
    assert_matches(ours(model, atoms), reference(calc64, atoms), energy_rel=1e-9, force=1e-8, stress=1e-9)
