"""YAML run configurations: the examples load, and every kind of mistake names its key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from halopipe.config import MODEL_TYPES, ConfigError, load_config, parse_config
from halopipe.demo import demo_pipeline, demo_system
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
    assert cfg.name == "argon_test" and cfg.nproc == 1 and cfg.data["domain"]["skin"] == 1.0
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
        (lambda d: d["models"]["lj"].update(epslon=1.0), "models.lj.epslon"),
        (lambda d: d["models"]["lj"].update(cutoff=-1.0), "models.lj"),
        (lambda d: d["models"]["lj"].update(type="LenardJones"), "models.lj.type"),
        (lambda d: d["models"]["lj"].pop("type"), "models.lj.type"),
        (lambda d: d["models"]["lj"].update(epsilon={"Xx": 0.1}), "models.lj.epsilon.Xx"),
        (lambda d: d["integrator"].update(timestep=-1.0), "integrator.timestep"),
        (lambda d: d.update(integrator={"type": "nhc", "timestep": 1.0, "temperature": 300, "chain": 0}), "integrator"),
        (lambda d: d["integrator"].update(timestep="fast"), "integrator.timestep"),
        (lambda d: d["integrator"].update(type="verlett"), "integrator.type"),
        (lambda d: d["integrator"].update(tempreature=300), "integrator.tempreature"),
        (lambda d: d.update(integrator={"type": "langevin", "timestep": 1.0}), "integrator.temperature"),
        (lambda d: d.update(domain={"skin": -0.5}), "domain.skin"),
        (lambda d: d.update(domain={"grid": [1, 2]}), "domain.grid"),
        (lambda d: d.update(domain={"halo": "wide"}), "domain.halo"),
        (lambda d: d.update(domain={"skn": 1.0}), "domain.skn"),
        (lambda d: d.update(system={"file": "does_not_exist.xyz"}), "system.file"),
        (lambda d: d.update(system={"generator": "graphene"}), "system.generator.type"),
        (lambda d: d.update(system={"generator": {"type": "argon", "cells": 0}}), "system.generator.cells"),
        (lambda d: d.update(system={"generator": "argon", "velocities": {"temperature": -3}}), "system.velocities.temperature"),
        (lambda d: d.update(system={}), "system"),
        (lambda d: d.update(groups=[{"steps": ["nope"]}]), "groups[0].steps[0].model"),
        (lambda d: d.update(groups=[{"steps": ["lj"], "autograd": "yes"}]), "groups[0].autograd"),
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
