"""examples/d3_mesh.yaml runs as a new user would run it (2 spawned ranks, a few MD steps), and DFTD3Mesh's YAML errors.

References: the logged step-0 potential energy against the configuration's pipeline evaluated on this
process; the YAML-built DFTD3Mesh against DFTD3's cutoff sums at 50 and 100 Å
extrapolated to an infinite cutoff (the same D3(BJ) parameters).
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path

import pytest
import yaml

from halopipe import DFTD3, Group, Pipeline, Step
from halopipe.config import ConfigError, load_config, parse_config
from halopipe.models.dftd3_mesh import DFTD3Mesh

from .test_run import cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "d3_mesh.yaml"


@pytest.mark.timeout(180)
def test_d3_mesh_example_runs_on_two_ranks(tmp_path, capfd):
    out = tmp_path / "run"
    assert cli("run", str(EXAMPLE), "--steps", "10", "--output", str(out)) == 0
    assert "2 rank(s)" in capfd.readouterr().out
    with open(out / "thermo.csv", newline="") as handle:
        log = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in log] == [0, 10]
    assert all(math.isfinite(float(r["potential_eV"])) for r in log)
    drift = abs(float(log[1]["conserved_eV"]) - float(log[0]["conserved_eV"]))
    assert drift < 1e-3, log  # NVT Nose-Hoover conserved quantity over 10 fs (forces consistent with the energy)
    cfg = load_config(EXAMPLE)
    reference = cfg.build_pipeline()(cfg.build_system(), decompose=False)
    assert float(log[0]["potential_eV"]) == pytest.approx(float(reference["energy"]), rel=1e-10, abs=0)


def test_d3_mesh_example_builds_dftd3mesh_sharing_pme_s_mesh():
    cfg = load_config(EXAMPLE)
    pipeline = cfg.build_pipeline()
    assert pipeline.names == [["lj"], ["charges", "pme", "d3"]] and pipeline.groups[1].autograd
    pme, d3 = pipeline.groups[1].steps[1].model, pipeline.groups[1].steps[2].model
    assert isinstance(d3, DFTD3Mesh) and d3.accuracy == 1e-5 and d3.order == pme.order == 5
    system = cfg.build_system()
    assert d3.mesh(system.cell, (11, 17)) == pme.mesh(system.cell)  # one mesh shape: one FFT plan under ranks
    # The YAML-built model is D3(BJ)-PBE with no cutoff: DFTD3's cutoff sums at 50 and 100 Å (tails 3e-4 and 3e-5
    # of the energy), extrapolated with X(rc) = X_inf + A rc^-3, give the same energy to the requested accuracy.
    mesh = float(Pipeline([Group([Step(d3)], autograd=True)])(system)["energy"])
    e50, e100 = (float(Pipeline([Group([Step(DFTD3("pbe", cutoff=rc))], autograd=True)])(system)["energy"]) for rc in (50.0, 100.0))
    assert abs(mesh - e50) > 1e-4 * abs(mesh)  # the 50 Å sum misses a visible tail
    assert mesh == pytest.approx(e100 + (e100 - e50) / 7.0, rel=2e-5)


@pytest.mark.parametrize(
    "change, key, words",
    [
        ({"damping": "zero"}, "models.d3.damping", ["'bj'", "'zero'"]),
        ({"order": 9}, "models.d3", ["order must be 4..6", "9"]),
        ({"accuracy": 2.0}, "models.d3", ["accuracy", "(0, 1)"]),
        ({"accuracy": 0}, "models.d3.accuracy", ["> 0"]),
        ({"mesh": "replicated"}, "models.d3.mesh", ["'slab'", "'pencil'"]),
        ({"mesh_size": [4, 4, 4]}, "models.d3", ["mesh_size", ">= 2 * order"]),
        ({"cutoff": 50.0}, "models.d3.cutoff", ["cutoff"]),  # no two-body cutoff to set
    ],
)
def test_bad_dftd3mesh_values_are_named_through_yaml(tmp_path, change, key, words):
    data = yaml.safe_load(EXAMPLE.read_text())
    data = copy.deepcopy(data)
    data["models"]["d3"].update(change)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "bad.yaml")
    assert info.value.key == key, str(info.value)
    assert all(word in str(info.value) for word in words), str(info.value)
    with pytest.raises(ConfigError):
        parse_config(data, base=EXAMPLE.parent)
