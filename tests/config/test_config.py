"""YAML run configurations: the examples load, and every kind of mistake names its key."""

from __future__ import annotations

import copy
import inspect
import re
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from halopipe import dynamics
from halopipe.config import (
    MODEL_SPECS,
    MODEL_TYPES,
    ConfigError,
    RunConfig,
    integrator_class,
    load_config,
    parse_config,
    resolve_model_type,
)
from halopipe.config.integrators import INTEGRATOR_SPECS
from halopipe.demo import demo_pipeline, demo_system
from halopipe.distributed import DomainConfig
from halopipe.dynamics import Langevin, NoseHooverChain, VelocityVerlet

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

BASE = {
    "system": {"generator": {"type": "argon", "cells": 2}},
    "models": {"lj": {"type": "LennardJones", "epsilon": 0.0104, "sigma": 3.4, "cutoff": 6.0}},
    "integrator": {"type": "velocity_verlet", "timestep": 2.0},
    "steps": 10,
}


def config(**changes) -> dict:
    data = copy.deepcopy(BASE)
    data.update(changes)
    return data


@pytest.mark.parametrize("name", ["demo.yaml", "argon.yaml", "charges_pme.yaml"])
def test_examples_load(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.build_system().n_atoms > 0
    assert cfg.build_pipeline().models


def test_demo_example_is_the_demo_composite():
    cfg = load_config(EXAMPLES / "demo.yaml")
    system = cfg.build_system()
    reference_system = demo_system(cells=4, rattle=0.1)
    assert torch.equal(system.positions, reference_system.positions)
    mine = cfg.build_pipeline()(system)
    reference = demo_pipeline()(reference_system)
    assert float(mine["energy"]) == pytest.approx(float(reference["energy"]), rel=1e-12)
    assert torch.allclose(mine["forces"], reference["forces"], atol=1e-10)
    assert isinstance(cfg.build_integrator(), VelocityVerlet)


def test_pme_example_wires_charges_into_pme():
    cfg = load_config(EXAMPLES / "charges_pme.yaml")
    pipeline = cfg.build_pipeline()
    assert pipeline.names == [["lj"], ["charges", "pme"]]
    assert pipeline.groups[1].autograd and type(pipeline.groups[1].steps[1].model).__name__ == "PME"
    assert isinstance(cfg.build_integrator(), NoseHooverChain)
    assert MODEL_TYPES["PME"] == "halopipe.models.pme:PME"


def test_defaults_and_element_keys():
    data = config(
        models={"lj": {"type": "LennardJones", "epsilon": {"Ar": 0.0104}, "sigma": {"Ar-Ar": 3.4}, "cutoff": 6.0}},
        integrator={"type": "langevin", "timestep": 1.0, "temperature": 300},
    )
    cfg = parse_config(data, source="x/argon_test.yaml")
    assert cfg.name == "argon_test" and cfg.nproc == 1 and cfg.data["domain"]["skin"] == DomainConfig().skin
    assert cfg.outputs["thermo_every"] == 10 and cfg.outputs["directory"].endswith("runs/argon_test")
    lj = cfg.build_pipeline().groups[0].steps[0].model
    assert float(lj.epsilon[18, 18]) == pytest.approx(0.0104) and float(lj.sigma[18, 18]) == pytest.approx(3.4)
    assert isinstance(cfg.build_integrator(), Langevin)


def test_system_from_file_relative_to_config(tmp_path):
    import ase.io
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((2, 2, 2))
    ase.io.write(tmp_path / "start.xyz", atoms, format="extxyz")
    data = config(system={"file": "start.xyz"})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    cfg = load_config(tmp_path / "run.yaml")
    assert torch.allclose(cfg.build_system().positions, torch.tensor(atoms.positions))


def test_min_distance_reaches_the_close_contact_check(tmp_path):
    from ase import Atoms

    Atoms("Ar2", positions=[[0, 0, 0], [0.3, 0, 0]], cell=[8, 8, 8], pbc=True).write(tmp_path / "close.xyz")
    default = parse_config(config(system={"file": "close.xyz"}), base=tmp_path).build_system()
    with pytest.raises(ValueError, match="0.3 Å apart, closer than min_distance=0.5"):
        default.check_close_contacts()
    lowered = parse_config(config(system={"file": "close.xyz", "min_distance": 0.2}), base=tmp_path).build_system()
    lowered.check_close_contacts()
    assert lowered.min_distance == 0.2


def test_per_element_charges_feed_a_model_that_needs_them():
    data = config(
        system={"generator": {"type": "argon", "cells": 2}, "charges": {"Ar": 0.25}},
        models={"coulomb": {"type": "DSFCoulomb", "cutoff": 5.0}},
    )
    system = parse_config(data).build_system()
    assert torch.equal(system.fields["charges"], torch.full((32,), 0.25))
    data["system"].pop("charges")
    with pytest.raises(ConfigError, match=r"'system'.*charges"):
        parse_config(data)


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d.update(stepz=3), "stepz"),
        (lambda d: d.pop("steps"), "steps"),
        (lambda d: d.update(steps=-1), "steps"),
        (lambda d: d.update(steps=2.5), "steps"),
        (lambda d: d.update(steps=True), "steps"),
        (lambda d: d["models"]["lj"].update(epslon=1.0), "models.lj.epslon"),
        (lambda d: d["models"]["lj"].update(cutoff=-1.0), "models.lj.cutoff"),
        (lambda d: d["models"]["lj"].update(cutoff=float("nan")), "models.lj.cutoff"),
        (lambda d: d["models"]["lj"].update(cutoff=float("inf")), "models.lj.cutoff"),
        (lambda d: d["models"]["lj"].update(epsilon={"NA": 0.1}), "models.lj.epsilon.NA"),
        (lambda d: d.update(models={"pme": {"type": "PME", "order": 9}}), "models.pme"),
        (lambda d: d.update(models={"mace": {"type": "MACE", "file": "none.model"}}), "models.mace.file"),
        (lambda d: d.update(models={"nn": {"type": "TorchModel", "cutoff": 3.0}}), "models.nn"),
        (lambda d: d["models"]["lj"].update(type="LenardJones"), "models.lj.type"),
        (lambda d: d["models"]["lj"].pop("type"), "models.lj.type"),
        (lambda d: d["models"]["lj"].update(epsilon={"Xx": 0.1}), "models.lj.epsilon.Xx"),
        (lambda d: d["integrator"].update(timestep=-1.0), "integrator.timestep"),
        (lambda d: d.update(integrator={"type": "nhc", "timestep": 1.0, "temperature": 300, "chain": 0}), "integrator.chain"),
        (lambda d: d.update(integrator={"type": "fire", "f_dec": 0.0}), "integrator.f_dec"),
        (lambda d: d["integrator"].update(timestep="fast"), "integrator.timestep"),
        (lambda d: d["integrator"].update(type="verlett"), "integrator.type"),
        (lambda d: d["integrator"].update(tempreature=300), "integrator.tempreature"),
        (lambda d: d.update(integrator={"type": "langevin", "timestep": 1.0}), "integrator.temperature"),
        (lambda d: d.update(domain={"skin": -0.5}), "domain.skin"),
        (lambda d: d.update(domain={"grid": [1, 2]}), "domain.grid"),
        (lambda d: d.update(domain={"halo": "wide"}), "domain.halo"),
        (lambda d: d.update(domain={"skn": 1.0}), "domain.skn"),
        (lambda d: d.update(domain={"timeout": float("inf")}), "domain.timeout"),
        (lambda d: d.update(domain={"grid": [1, 1, 1.5]}), "domain.grid[2]"),
        (lambda d: d.update(system={"file": "does_not_exist.xyz"}), "system.file"),
        (lambda d: d.update(system={"generator": "graphene"}), "system.generator.type"),
        (lambda d: d.update(system={"generator": {"type": "argon", "cells": 0}}), "system.generator.cells"),
        (lambda d: d.update(system={"generator": "argon", "velocities": {"temperature": -3}}), "system.velocities.temperature"),
        (lambda d: d.update(system={}), "system"),
        (lambda d: d.update(system={"generator": "argon", "index": 0}), "system.index"),
        (lambda d: d.update(system={"generator": "argon", "charges": {"Ar": "x"}}), "system.charges.Ar"),
        (lambda d: d.update(system={"generator": "argon", "min_distance": -0.1}), "system.min_distance"),
        (lambda d: d.update(groups=[{"steps": ["nope"]}]), "groups[0].steps[0].model"),
        (lambda d: d.update(groups=[{"steps": ["lj"], "autograd": "yes"}]), "groups[0].autograd"),
        (lambda d: d.update(groups=[{"steps": ["lj"]}, {"steps": ["lj"]}]), "groups[1].steps[0].model"),
        (lambda d: d.update(outputs={"thermo_every": "often"}), "outputs.thermo_every"),
        (lambda d: d.update(outputs={"plots": True}), "outputs.plots"),
        (lambda d: d.update(nproc=0), "nproc"),
        (lambda d: d.update(precision="float16"), "precision"),
    ],
)
def test_errors_name_the_key(mutate, key):
    data = config()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data, base=".")
    assert info.value.key == key, str(info.value)
    assert f"'{key}'" in str(info.value)


def test_unused_model_and_broken_wiring_are_reported():
    data = config(models={**BASE["models"], "extra": {"type": "DSFCoulomb", "cutoff": 5.0}}, groups=[{"steps": ["lj"]}])
    with pytest.raises(ConfigError, match="models.extra"):
        parse_config(data)
    data = config(
        system={"generator": "nacl"},
        models={"q": {"type": "ChargeModel", "cutoff": 4.0}, "c": {"type": "DSFCoulomb", "cutoff": 6.0}},
        groups=[{"steps": ["q"]}, {"steps": ["c"]}],
    )
    with pytest.raises(ConfigError, match="'groups'.*chain term"):
        parse_config(data)


def test_custom_model_class_by_path():
    data = config(models={"lj": {"type": "halopipe.models.lennard_jones:LennardJones", "cutoff": 6.0}})
    assert parse_config(data).build_pipeline().models[0].cutoff == 6.0


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


# ----------------------------------------------------------------- new checks
def test_skin_has_one_owner():
    """Unset, the skin is DomainConfig's default; set, it reaches the pipeline and the domain alike."""
    cfg = parse_config(config())
    assert cfg.domain_config() == DomainConfig()
    assert cfg.build_pipeline().config == DomainConfig() and DomainConfig().skin == 1.0
    cfg = parse_config(config(domain={"skin": 0.7, "grid": [np.int64(1), np.int64(1), np.int64(2)]}))
    assert cfg.build_pipeline().config.skin == cfg.domain_config().skin == 0.7
    grid = cfg.domain_config().grid
    assert grid == (1, 1, 2) and all(type(g) is int for g in grid)  # numpy integers are accepted, as ints


def test_numpy_numbers_are_accepted():
    data = config(steps=np.int64(7), integrator={"type": "velocity_verlet", "timestep": np.float32(2.0)})
    cfg = parse_config(data)
    assert cfg.steps == 7 and type(cfg.steps) is int and cfg.build_integrator().timestep == 2.0


def test_pipeline_is_built_once(monkeypatch):
    from halopipe.models import lennard_jones

    built = []
    original = lennard_jones.LennardJones.__init__

    def counting(self, *args, **kwargs):
        built.append(kwargs)
        original(self, *args, **kwargs)

    monkeypatch.setattr(lennard_jones.LennardJones, "__init__", counting)
    parse_config(config())
    assert len(built) == 1


@pytest.mark.parametrize(
    "models, key, element",
    [
        ({"lj": {"type": "LennardJones", "epsilon": {"Na": 0.01}, "sigma": {"Na": 2.0}, "cutoff": 6.0}}, "models.lj", "Ar"),
        ({"q": {"type": "ChargeModel"}, "c": {"type": "DSFCoulomb", "cutoff": 5.0}}, "models.q", "Ar"),
    ],
)
def test_missing_species_are_named_by_symbol_when_loading(models, key, element):
    data = config(models=models, groups=[{"steps": list(models)}])
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == key and re.search(rf"\b{element}\b", str(info.value)) and "18" not in str(info.value), str(info.value)


def test_lj_pair_without_parameters_is_named():
    data = config(
        system={"generator": "nacl"},
        models={"lj": {"type": "LennardJones", "epsilon": {"Na": 0.01, "Cl": 0.004}, "sigma": {"Na-Na": 2.0, "Cl-Cl": 3.4}, "cutoff": 6.0}},
    )
    with pytest.raises(ConfigError, match="Na-Cl") as info:
        parse_config(data)
    assert info.value.key == "models.lj"


def test_lowercase_element_symbols_work():
    upper = parse_config(
        config(
            system={"generator": "nacl", "charges": {"Na": 1.0, "Cl": -1.0}},
            models={"lj": {"type": "LennardJones", "epsilon": {"Na": 0.01, "Cl": 0.004}, "sigma": {"Na-Cl": 2.7, "Na": 2.0, "Cl": 3.4}}},
        )
    )
    lower = parse_config(
        config(
            system={"generator": "nacl", "charges": {"na": 1.0, "cl": -1.0}},
            models={"lj": {"type": "LennardJones", "epsilon": {"na": 0.01, "cl": 0.004}, "sigma": {"na-cl": 2.7, "na": 2.0, "cl": 3.4}}},
        )
    )
    assert lower.data == upper.data  # stored as canonical symbols
    a, b = upper.build_pipeline().models[0], lower.build_pipeline().models[0]
    assert torch.equal(a.epsilon, b.epsilon) and torch.equal(a.sigma, b.sigma)
    assert float(a.sigma[11, 17]) == 2.7 and float(a.sigma[11, 11]) == 2.0
    assert torch.equal(lower.build_system().fields["charges"], upper.build_system().fields["charges"])
    with pytest.raises(ConfigError, match="write 'Na'"):
        parse_config(config(models={"lj": {"type": "LennardJones", "epsilon": {"NA": 0.01}}}))


def test_structure_file_is_named_as_such(tmp_path):
    import ase.io
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((2, 2, 2))
    for name in ("start.xyz", "start.traj"):
        ase.io.write(tmp_path / name, atoms)
        with pytest.raises(ConfigError) as info:
            load_config(tmp_path / name)
        text = str(info.value)
        assert info.value.key == "<file>" and "structure file" in text and f"system: {{file: {name}}}" in text
        assert len(text) < 300 and "Lattice" not in text and "5.26" not in text  # the contents are not dumped
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="not a halopipe configuration") as info:
        load_config(tmp_path / "list.yaml")
    assert "looks like a structure file" not in str(info.value)


def test_yaml_errors_give_the_line_without_the_text(tmp_path):
    (tmp_path / "bad.yaml").write_text("steps: 3\nsystem: {generator: argon\nsecret_marker: 1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line \d+, column \d+") as info:
        load_config(tmp_path / "bad.yaml")
    assert "secret_marker" not in str(info.value)


def test_data_is_a_complete_round_trip():
    """``RunConfig(config.data)`` (what spawned ranks get) and its YAML dump are the same configuration."""
    for name in ("demo.yaml", "argon.yaml", "charges_pme.yaml"):
        cfg = load_config(EXAMPLES / name, check_system=False)
        assert RunConfig(cfg.data, cfg.source).data == cfg.data
        assert parse_config(yaml.safe_load(yaml.safe_dump(cfg.data)), check_system=False).data == cfg.data
    assert cfg.with_steps(5).steps == 5 and cfg.with_steps(5).data == {**cfg.data, "steps": 5}
    with pytest.raises(ConfigError, match="'steps'"):
        cfg.with_steps(-1)


def test_specs_cover_every_constructor_parameter():
    """A model's or integrator's parameters are exactly its spec's fields (a module comes from file or factory)."""
    loaders = {"file", "factory", "options"}
    set_by_precision = {"SevenNet": {"dtype"}}  # the configuration's `precision` casts the whole pipeline
    for name, spec in MODEL_SPECS.items():
        accepted = set(list(inspect.signature(resolve_model_type(name, "type").__init__).parameters)[1:]) - {"module"}
        accepted -= set_by_precision.get(name, set())
        assert set(spec.model_fields) - {"type"} - loaders == accepted, name
    for spec in INTEGRATOR_SPECS:
        for kind in typing.get_args(spec.model_fields["type"].annotation):
            classes = [integrator_class(kind)] + [getattr(dynamics, n) for n in [getattr(spec, "anisotropic_class_name", None)] if n]
            accepted = set().union(*(list(inspect.signature(cls.__init__).parameters)[1:] for cls in classes))
            assert set(spec.model_fields) - {"type"} - set(getattr(spec, "selectors", ())) == accepted, kind


class PairEnergy(torch.nn.Module):
    """Per-atom energy ``weight * sum_j exp(-r_ij) / 2``: a graph module for TorchModel."""

    def __init__(self, weight: float = 1.0) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, numbers, pairs, vectors, n_nodes):
        r = vectors.norm(dim=1)
        return torch.zeros(n_nodes, dtype=vectors.dtype).index_add(0, pairs[0], 0.5 * self.weight * torch.exp(-r))


def _pair_energy_reference(atoms, cutoff: float) -> float:
    """sum over pairs within the cutoff of exp(-r), by brute force with the minimum image (cubic box, cutoff < L/2)."""
    length = atoms.cell.lengths()[0]
    d = atoms.positions[:, None, :] - atoms.positions[None, :, :]
    d -= length * np.round(d / length)
    r = np.linalg.norm(d, axis=-1)[np.triu_indices(len(atoms), 1)]
    return float(np.exp(-r[r <= cutoff]).sum())


def test_torch_model_from_file_and_factory(tmp_path):
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((2, 2, 2))
    reference = _pair_energy_reference(atoms, 4.0)
    torch.save(PairEnergy(), tmp_path / "pair.pt")
    sources = {"file": {"file": "pair.pt"}, "factory": {"factory": f"{__name__}:PairEnergy", "options": {"weight": 2.0}}}
    for source, weight in (("file", 1.0), ("factory", 2.0)):
        data = config(models={"nn": {"type": "TorchModel", "cutoff": 4.0, **sources[source]}})
        cfg = parse_config(data, base=tmp_path)
        energy = float(cfg.build_pipeline()(cfg.build_system())["energy"])
        assert energy == pytest.approx(weight * reference, rel=1e-12), source
    data = config(models={"nn": {"type": "TorchModel", "cutoff": 4.0, "factory": f"{__name__}:PairEnergy", "options": {"wait": 1}}})
    with pytest.raises(ConfigError, match="rejected") as info:
        parse_config(data)
    assert info.value.key == "models.nn.options"


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mace_model_file_matches_mace_calculator_and_its_species_are_checked(tmp_path):
    pytest.importorskip("mace")
    import ase.io

    from tests.models.test_mace import build_model, mace_reference, make_atoms

    model = build_model("scaleshift_L2_corr3")  # H, C, O
    torch.save(model, tmp_path / "small.model")
    atoms = make_atoms(True)
    ase.io.write(tmp_path / "hco.xyz", atoms, format="extxyz")
    data = config(system={"file": "hco.xyz"}, models={"mace": {"type": "MACE", "file": "small.model"}})
    cfg = parse_config(data, base=tmp_path)
    out = cfg.build_pipeline()(cfg.build_system())
    reference = mace_reference(model, ase.io.read(tmp_path / "hco.xyz"))
    assert float(out["energy"]) == pytest.approx(reference["energy"], rel=1e-10)
    np.testing.assert_allclose(out["forces"].detach().numpy(), reference["forces"], atol=1e-8)
    atoms.numbers[0] = 14
    ase.io.write(tmp_path / "hco.xyz", atoms, format="extxyz")
    with pytest.raises(ConfigError, match=r"no Si \(it knows H, C, O\)") as info:
        parse_config(data, base=tmp_path)
    assert info.value.key == "models.mace"


def test_dftd3_without_reference_data_is_named(tmp_path):
    import ase
    import ase.io

    atoms = ase.Atoms("ArRf", positions=[[0, 0, 0], [3.0, 0, 0]], cell=[8.0, 8.0, 8.0], pbc=True)
    ase.io.write(tmp_path / "rf.xyz", atoms, format="extxyz")
    data = config(system={"file": "rf.xyz"}, models={"d3": {"type": "DFTD3", "functional": "pbe", "cutoff": 6.0}})
    with pytest.raises(ConfigError, match=r"no D3 reference data for Rf\b") as info:
        parse_config(data, base=tmp_path)
    assert info.value.key == "models.d3"


def test_several_problems_are_listed_by_key():
    data = config(steps=-1, nproc=0, domain={"skin": -1.0})
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "domain.skin" and str(info.value).endswith("(also: nproc, steps)"), str(info.value)


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_mlip_keeps_its_weights_dtype_under_the_run_precision(tmp_path):
    """A float32 MACE file in a float64 run stays float32 (its trained precision) and gives the Python API's numbers."""
    pytest.importorskip("mace")
    import ase.io

    from halopipe import MACE, Pipeline, System
    from tests.models.test_mace import build_model, make_atoms

    model = build_model("scaleshift_L2_corr3").float()
    torch.save(model, tmp_path / "small32.model")
    ase.io.write(tmp_path / "hco.xyz", make_atoms(True), format="extxyz")
    data = config(system={"file": "hco.xyz"}, models={"mace": {"type": "MACE", "file": "small32.model"}})
    cfg = parse_config(data, base=tmp_path)
    pipeline, system = cfg.build_pipeline(), cfg.build_system()
    assert cfg.dtype == torch.float64 and system.dtype == torch.float64
    assert pipeline.models[0].dtype == torch.float32
    got = pipeline(system)
    want = Pipeline([MACE(torch.load(tmp_path / "small32.model", weights_only=False))])(System.from_ase(ase.io.read(tmp_path / "hco.xyz")))
    assert float(got["energy"]) == pytest.approx(float(want["energy"]), rel=1e-12)
    torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-12)
