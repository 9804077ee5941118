"""MACE wrapper against mace-torch's own calculator (single process, float64).

Random-weight mace-torch models are built here (no downloads); the reference is
``mace.calculators.MACECalculator`` on the same model, which builds its own
periodic graph and differentiates mace's own ``forward``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

mace = pytest.importorskip("mace")  # importing mace first lets e3nn 0.4.4 load its constants under torch >= 2.6
ase = pytest.importorskip("ase")
from e3nn import o3
from mace import modules
from mace.calculators import MACECalculator

from halopipe.models.mace import MACE
from halopipe.pipeline import Group, Pipeline, Step
from halopipe.system import System
from halopipe.testing import check_empty_view, check_model

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

SPECIES = (1, 6, 8)

# name -> (class, r_max, interactions, correlation, hidden irreps, first interaction, ZBL pair repulsion)
CONFIGS = {
    "scaleshift_L2_corr3": ("ScaleShiftMACE", 3.5, 2, 3, "8x0e+8x1o+8x2e", "RealAgnosticResidualInteractionBlock", False),
    "mace_L3_corr2_zbl": ("MACE", 3.0, 3, 2, "6x0e+6x1o", "RealAgnosticInteractionBlock", True),
}


def build_model(name: str) -> torch.nn.Module:
    """A small mace-torch model with random (perturbed) weights, float64."""
    kind, r_max, n_int, corr, hidden, first, zbl = CONFIGS[name]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(7)
        kwargs = {
            "r_max": r_max,
            "num_bessel": 6,
            "num_polynomial_cutoff": 5,
            "max_ell": 2,
            "interaction_cls": modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            "interaction_cls_first": modules.interaction_classes[first],
            "num_interactions": n_int,
            "num_elements": len(SPECIES),
            "hidden_irreps": o3.Irreps(hidden),
            "MLP_irreps": o3.Irreps("8x0e"),
            "atomic_energies": np.array([-1.1, -2.3, -3.7]),
            "avg_num_neighbors": 6.0,
            "atomic_numbers": list(SPECIES),
            "correlation": corr,
            "gate": torch.nn.functional.silu,
            "radial_MLP": [8, 8],
            "pair_repulsion": zbl,
        }
        if kind == "ScaleShiftMACE":
            model = modules.ScaleShiftMACE(atomic_inter_scale=1.3, atomic_inter_shift=-0.2, **kwargs)
        else:
            model = modules.MACE(**kwargs)
        with torch.no_grad():  # default init gives tiny interaction energies; make them O(1)
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    finally:
        torch.set_default_dtype(old)
    return model.double()


def make_atoms(periodic: bool, n_side: int = 3, seed: int = 0):
    """Rattled grid (no close contacts) of random species, triclinic cell or cluster."""
    rng = np.random.default_rng(seed)
    cell = np.array([[7.0, 0.0, 0.0], [1.2, 7.4, 0.0], [-0.8, 0.9, 7.2]]) * n_side / 3
    grid = np.stack(np.meshgrid(*[np.arange(n_side)] * 3, indexing="ij"), -1).reshape(-1, 3) / n_side
    frac = grid + rng.uniform(-0.06, 0.06, grid.shape)
    atoms = ase.Atoms(numbers=rng.choice(SPECIES, len(frac)), scaled_positions=frac, cell=cell, pbc=periodic)
    if not periodic:
        atoms.cell[:] = 0.0
    return atoms


def mace_reference(model: torch.nn.Module, atoms) -> dict:
    atoms = atoms.copy()
    atoms.calc = MACECalculator(models=model, default_dtype="float64", device="cpu")
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces()}
    if atoms.pbc.all():
        out["stress"] = atoms.get_stress(voigt=False)
    return out


def ours(model: MACE, atoms) -> dict:
    periodic = bool(atoms.pbc.all())
    out = Pipeline([Group([Step(model)], autograd=True)])(System.from_ase(atoms), stress=periodic)
    return {k: out[k].detach().numpy() for k in ("energy", "forces", "stress") if k in out}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return build_model(request.param)


@pytest.mark.parametrize("periodic", [True, False], ids=["triclinic", "cluster"])
def test_matches_mace_calculator(model, periodic):
    atoms = make_atoms(periodic)
    ref = mace_reference(model, atoms)
    e0 = float(model.atomic_energies_fn(torch.eye(len(SPECIES), dtype=torch.float64)).sum())
    assert abs(ref["energy"] - e0) > 1e-2  # the interaction part is not negligible
    for mode in ("layer", "wide"):
        got = ours(MACE(model, halo_mode=mode), atoms)
        assert abs(got["energy"] - ref["energy"]) <= 1e-10 * abs(ref["energy"]), mode
        np.testing.assert_allclose(got["forces"], ref["forces"], rtol=0, atol=1e-9, err_msg=mode)
        if periodic:
            np.testing.assert_allclose(got["stress"], ref["stress"], rtol=0, atol=1e-9, err_msg=mode)


def test_halo_widths(model):
    r_max, n_int = float(model.r_max), len(model.interactions)
    assert MACE(model).halo == pytest.approx(r_max)
    assert MACE(model).cutoff == pytest.approx(r_max)
    assert MACE(model, halo_mode="wide").halo == pytest.approx(n_int * r_max)


def test_per_atom_energies_match_mace():
    """Owned per-atom energies (E0 + scaled readouts) equal mace's per-atom energies."""
    model = build_model("scaleshift_L2_corr3")
    atoms = make_atoms(True)
    calc = MACECalculator(models=model, default_dtype="float64", device="cpu")
    atoms.calc = calc
    atoms.get_potential_energy()

    class Recording(MACE):
        def forward(self, view, direct=False):
            out = super().forward(view, direct)
            self.seen = (view.ids[: view.n_owned], out.energies.detach())
            return out

    wrapper = Recording(model)
    ours(wrapper, atoms)
    ids, values = wrapper.seen
    energies = torch.zeros(len(atoms), dtype=torch.float64).index_add(0, ids, values).numpy()
    np.testing.assert_allclose(energies, calc.results["energies"], rtol=0, atol=1e-11)  # E0 included


def test_from_file_and_float32(tmp_path):
    model = build_model("scaleshift_L2_corr3")
    path = tmp_path / "small.model"
    torch.save(model, path)
    atoms = make_atoms(True)
    ref = ours(MACE(model), atoms)
    loaded = ours(MACE.from_file(path), atoms)
    assert loaded["energy"] == pytest.approx(ref["energy"], rel=1e-12)
    # dtype follows the model: a float32 copy runs on a float64 system.
    single = MACE(build_model("scaleshift_L2_corr3").float())
    assert single.dtype == torch.float32
    got = ours(single, atoms)
    assert got["energy"] == pytest.approx(ref["energy"], rel=1e-5)
    np.testing.assert_allclose(got["forces"], ref["forces"], atol=1e-4)


def test_bad_input(tmp_path):
    model = build_model("scaleshift_L2_corr3")
    with pytest.raises(ValueError, match="halo_mode"):
        MACE(model, halo_mode="narrow")
    with pytest.raises(ValueError, match="head"):
        MACE(model, head="pbe")
    with pytest.raises(ValueError, match="no such file"):
        MACE.from_file(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="not a mace-torch"):
        MACE(torch.nn.Linear(2, 2))
    atoms = make_atoms(True)
    atoms.numbers[0] = 14  # Si: not in the model
    with pytest.raises(ValueError, match=r"\[14\]"):
        ours(MACE(model), atoms)


def test_check_model():
    model = build_model("scaleshift_L2_corr3")
    atoms = make_atoms(True, n_side=2)  # 8 atoms in a small triclinic cell: many periodic images
    check_model(MACE(model), System.from_ase(atoms))


@pytest.mark.parametrize("halo_mode", ["layer", "wide"])
def test_rank_without_atoms(model, halo_mode):
    """A view owning no atoms (with ghost rows, and with none) runs, gives nothing, and refreshes like a populated one.

    mace's symmetric contraction cannot reshape zero rows; this once crashed a rank whose brick was empty.
    """
    check_empty_view(MACE(model, halo_mode=halo_mode), System.from_ase(make_atoms(True)))
