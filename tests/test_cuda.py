"""CUDA checks: run only where a GPU is present (a lent device machine); CI has none.

The same pipeline on a CUDA system must equal the CPU result to float64 rounding,
single-process and through the distributed path with one rank.
"""

import pytest
import torch

from halopipe import DFTD3, ChargeModel, DSFCoulomb, Group, LennardJones, Pipeline, Step
from halopipe.distributed import ShardedSystem

from .conftest import triclinic_nacl

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def composite() -> Pipeline:
    return Pipeline(
        [
            Group([Step(LennardJones({11: 0.0115, 17: 0.0043}, {11: 2.6, 17: 3.6}, cutoff=6.0))], autograd=False),
            Group([Step(ChargeModel(3.5)), Step(DSFCoulomb(7.0, 0.2)), Step(DFTD3("pbe", cutoff=8.0, cn_cutoff=6.0))], autograd=True),
        ]
    )


def test_cuda_equals_cpu_single_process_and_one_rank():
    system = triclinic_nacl()
    ref = composite()(system, stress=True)
    gpu_system = system.to(device="cuda")
    out = composite().to("cuda")(gpu_system, stress=True)
    assert out["forces"].device.type == "cuda"
    assert abs(float(out["energy"] - ref["energy"])) < 1e-10
    assert float((out["forces"].cpu() - ref["forces"]).abs().max()) < 1e-10
    assert float((out["stress"].cpu() - ref["stress"]).abs().max()) < 1e-12
    pipeline = composite().to("cuda")
    sharded = ShardedSystem.scatter(gpu_system, pipeline.config)
    dout = pipeline(sharded, stress=True)
    forces = sharded.gather(dout["forces"]).cpu()
    assert float((forces - ref["forces"]).abs().max()) < 1e-10
