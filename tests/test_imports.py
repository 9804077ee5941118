"""The import graph: no cycles, and the core free of halopipe.distributed (scripts/check_imports.py)."""

import importlib
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_imports.py"


def run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "halopipe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "halopipe"


def test_halopipe_has_no_cycles_and_a_core_free_of_distributed():
    result = run(SCRIPT.parent.parent / "halopipe")
    assert result.returncode == 0, result.stdout + result.stderr


def test_checker_reports_a_cycle_hidden_in_a_function(tmp_path):
    package = write(
        tmp_path,
        {
            "__init__.py": "from .a import A\n",
            "a.py": "from .b import B\nA = 1\n",
            "b.py": "def f():\n    from .a import A\n    return A\nB = 2\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
        },
    )
    result = run(package)
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["import cycle: halopipe.a -> halopipe.b -> halopipe.a"]


def test_checker_reports_core_importing_distributed_and_the_package_init_it_runs(tmp_path):
    package = write(
        tmp_path,
        {
            "__init__.py": "",
            "domain.py": "def build():\n    from .distributed.partition import P\n    return P\n",
            "pipeline.py": "from .domain import build\n",
            "distributed/__init__.py": "from ..pipeline import build\n",
            "distributed/partition.py": "P = 1\n",
        },
    )
    lines = run(package).stdout.splitlines()
    assert "import cycle: halopipe.distributed -> halopipe.pipeline -> halopipe.domain -> halopipe.distributed" in lines
    assert any(line.startswith("layering: core module halopipe.domain imports halopipe.distributed.partition") for line in lines)


def test_top_level_all_names_exactly_the_lazy_exports_and_each_resolves():
    import halopipe

    assert sorted(halopipe.__all__) == sorted([*halopipe._EXPORTS, "__version__"])
    for name in halopipe._EXPORTS:
        assert getattr(halopipe, name) is getattr(importlib.import_module(halopipe._EXPORTS[name]), name)
