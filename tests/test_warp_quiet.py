"""A process on a machine without a CUDA driver prints nothing from Warp (issue 23).

Warp's native init writes a "no CUDA driver" warning to the C-level stderr; halopipe initialises Warp so that
the line is dropped. The reference is bare Warp in the same environment: it must print the warning (otherwise
this machine has a driver and there is nothing to hide), and halopipe's process, running a Warp kernel, must not.
"""

import subprocess
import sys

import pytest

from halopipe.kernels.backend import kernel_backend

BARE_WARP = "import warp; warp.config.log_level = 40; warp.init()"

LJ_ARGON = """
from ase.build import bulk
from halopipe import LennardJones, Pipeline, System
from halopipe.kernels.backend import kernel_backend

assert kernel_backend() == "warp", kernel_backend()
system = System.from_ase(bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3))
out = Pipeline([LennardJones({18: 0.0104}, {18: 3.4}, cutoff=8.0)])(system)
print(float(out["energy"]))
"""


def stderr_of(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return result.stderr


@pytest.mark.skipif(kernel_backend() != "warp", reason="Warp is not the kernel backend here")
def test_no_cuda_warning_from_a_warp_evaluation():
    if "CUDA" not in stderr_of(BARE_WARP):
        pytest.skip("bare Warp prints no CUDA warning here (a CUDA driver is present)")
    stderr = stderr_of(LJ_ARGON)
    assert "CUDA" not in stderr, stderr
