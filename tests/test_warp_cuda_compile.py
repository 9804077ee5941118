"""Every halopipe Warp kernel compiles for sm_90 (CUDA arch 90) on a machine without a GPU (issue 22).

Warp's NVRTC compiles CUDA code without a driver, so CUDA compile errors surface in CI before a GPU is lent.
Each ``halopipe/kernels/_warp_*.py`` is found by glob; its Warp module is compiled ahead of time, and so is every
module of the kernels it builds on demand (listed by its ``every_kernel()``, e.g. the per-order mesh kernels).
"""

import importlib
from pathlib import Path

import pytest

import halopipe.kernels
from halopipe.kernels.backend import warp_module

WARP_SOURCES = sorted(Path(halopipe.kernels.__file__).parent.glob("_warp_*.py"))

pytestmark = pytest.mark.skipif(warp_module() is None, reason="Warp is not available")


def warp_modules_of(source: Path) -> list:
    """The Warp modules holding the kernels of ``source``: its own (when it has kernels), then its on-demand ones."""
    wp = warp_module()
    python_module = importlib.import_module(f"halopipe.kernels.{source.stem}")
    own = wp.get_module(python_module.__name__)
    on_demand = [kernel.module for kernel in getattr(python_module, "every_kernel", list)()]
    return ([own] if own.kernels else []) + list(dict.fromkeys(on_demand))


def test_discovery_finds_the_known_kernel_sources():
    known = {"_warp_pairs", "_warp_electrostatics", "_warp_lists", "_warp_geometry", "_warp_mesh"}
    assert known <= {source.stem for source in WARP_SOURCES}


@pytest.mark.parametrize("source", WARP_SOURCES, ids=lambda source: source.stem)
def test_every_kernel_compiles_for_sm90(source, tmp_path):
    wp = warp_module()
    modules = warp_modules_of(source)
    assert modules, f"{source.name} has no kernels at import; list the ones it builds on demand in every_kernel()"
    for module in modules:
        # Warp skips a generic kernel without overloads with only a warning; here that is a failure.
        generic = [key for key, kernel in module.kernels.items() if kernel.is_generic and not kernel.overloads]
        assert not generic, f"{module.name}: generic kernels without wp.overload: {generic}"
        paths = wp.compile_aot_module(module, arch=90, module_dir=tmp_path / module.name, use_ptx=False)
        assert paths, module.name
        for path in paths:
            assert path.name.endswith(".sm90.cubin") and path.stat().st_size > 0, path
