"""The ``halopipe`` entry point: version, lazy start, one-line failures with the failing rank, structure files named."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ._helpers import ROOT, halopipe, write_config


def test_version_matches_the_package_metadata(tmp_path):
    expected = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    done = halopipe("--version", cwd=tmp_path, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"halopipe {expected}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"]])
def test_help_and_version_do_not_import_torch(argv):
    code = (
        "import sys\nfrom halopipe.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('torch imported' if 'torch' in sys.modules else 'torch not imported')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().endswith("torch not imported"), done.stdout + done.stderr


@pytest.mark.parametrize("name", ["structure.xyz", "POSCAR", "crystal.cif"])
def test_a_structure_file_given_as_configuration_is_named_as_such(tmp_path, name):
    (tmp_path / name).write_text('2\nLattice="5 0 0 0 5 0 0 0 5"\nAr 0.0 0.0 0.0\nAr 1.5 2.5 3.5\n')
    done = halopipe("run", name, cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"halopipe run: error: {name} looks like a structure file")
    assert "Lattice" not in done.stderr and "2.5" not in done.stderr  # its contents are not dumped


def _failing(tmp_path, **model):
    lj = {"type": "tests.cli._helpers:FailingLJ", "epsilon": 0.0104, "sigma": 3.4, "cutoff": 6.0, **model}
    # a short collective timeout bounds the test where a peer's failure is only seen at the timeout
    return write_config(tmp_path / "fail.yaml", models={"lj": lj}, nproc=2, domain={"skin": 0.5, "timeout": 10})


@pytest.mark.timeout(150)
def test_a_failing_rank_gives_one_line_naming_it_and_debug_adds_the_traceback(tmp_path):
    cfg = _failing(tmp_path, fail_rank=1, fail_call=3, message="the model gave up")
    done = halopipe("run", str(cfg), "--output", str(tmp_path / "out"), cwd=ROOT, timeout=140)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("halopipe run: error")]
    assert len(errors) == 1 and "Traceback" not in done.stderr
    assert errors[0].startswith("halopipe run: error on rank ") and "rank 1" in errors[0]
    assert "MD step 2: " in errors[0] and "the model gave up" in errors[0]
    debug = halopipe("run", str(cfg), "--output", str(tmp_path / "out2"), "--debug", cwd=ROOT, timeout=140)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "the model gave up" in debug.stderr


@pytest.mark.timeout(60)
def test_a_failure_in_one_process_gives_one_line_without_rank(tmp_path):
    cfg = _failing(tmp_path, fail_rank=0, fail_call=1, message="non-finite energy")
    done = halopipe("run", str(cfg), "--nproc", "1", "--output", str(tmp_path / "out"), cwd=ROOT, timeout=50)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "halopipe run: error: MD step 0: non-finite energy"
    assert "Traceback" not in done.stderr


def test_schema_prints_the_configuration_json_schema(tmp_path):
    import json

    from halopipe import config

    done = halopipe("schema", cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    schema = json.loads(done.stdout)
    assert schema == config.config_schema() and {"models", "integrator", "steps"} <= set(schema.get("properties", {}))
