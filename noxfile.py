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
"""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

nox.options.sessions = ["tests", "sevenn"]
nox.options.error_on_missing_interpreters = True

TORCH = "torch==2.13.0"
ENV = {"OMP_NUM_THREADS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
SEVENN_TESTS = "test_*sevenn*.py"  # the test files of the sevenn session (their tests are also marked 'sevenn')


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The core suite, MACE and torch-sim (everything but the sevenn-marked tests)."""
    _install(session, "test,mace,torchsim")
    session.run("python", "-m", "pytest", "-q", "-m", "not sevenn", f"--ignore-glob=*/{SEVENN_TESTS}", *session.posargs, env=ENV)


@nox.session
def sevenn(session: nox.Session) -> None:
    """SevenNet: model, distributed and example tests, in an environment with e3nn >= 0.5; no skips allowed."""
    _install(session, "test,sevenn")
    report = Path(session.create_tmp()) / "sevenn-junit.xml"
    files = sorted(str(p) for p in Path("tests").glob(f"**/{SEVENN_TESTS}"))
    session.run("python", "-m", "pytest", "-q", "-m", "sevenn", f"--junitxml={report}", *files, *session.posargs, env=ENV)
    skipped = _skipped_tests(report)
    if skipped:
        session.error(f"{len(skipped)} sevenn test(s) were skipped, but this session must run them all: {skipped}")


def _skipped_tests(report: Path) -> list[str]:
    """Names of the skipped test cases in a JUnit XML report."""
    root = ElementTree.parse(report).getroot()
    return [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase") if case.find("skipped") is not None]
