"""D3(BJ) by particle mesh in composites on two ranks (gloo, CPU, float64), and the mesh shared with PME.

Reference: the composite's parts evaluated separately on one process (rank 0, ``decompose=False``) and
summed (``tests/models/test_dftd3_mesh_composite.py`` checks the same on one process). Composites: a
random-weight MACE + DFTD3Mesh in one autograd group; ChargeModel -> PME (distributed mesh) + DFTD3Mesh in
one autograd group on a mesh of the same shape. Energy 1e-12 relative, forces 1e-10 eV/Å, stress 1e-12
relative to its largest component.

Sharing: ``ShardedSystem.mesh_transform`` caches one transform per (mesh shape, requested decomposition),
so PME and DFTD3Mesh with the same shape (both asking for ``"auto"``) get the same transform object: one
process grid and sub-communicators, one set of padded box maps (the same B-spline order gives both models
the same boxes, so one map serves both). Exchanges are not merged: PME's one channel and D3's ``L x S``
channels each run their own transposes.
"""

from __future__ import annotations

import pytest

from halopipe.distributed.launch import spawn

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def composites_on_ranks(names: list[str]) -> list[dict] | None:
    import torch.distributed as dist

    from halopipe import DomainConfig, Pipeline
    from halopipe.distributed import ShardedSystem
    from halopipe.models.dftd3_mesh import DFTD3Mesh
    from halopipe.models.pme import PME

    from ..models.test_dftd3_mesh_composite import composites, differences, sum_of_parts

    results = []
    for name in names:
        make_system, groups = composites()[name]
        system = make_system()
        config = DomainConfig(grid=(2, 1, 1), timeout=100)
        pipeline = Pipeline(groups(), config=config)
        sharded = ShardedSystem.scatter(system if dist.get_rank() == 0 else None, config)
        out = pipeline(sharded, stress=True)
        out["forces"] = sharded.gather(out["forces"])
        if name == "pme_d3":
            pipeline(sharded)  # no stress: a constant cell, so both models cache their kernel with its transform
            pme, d3 = [m for m in pipeline.models if isinstance(m, PME)][0], [m for m in pipeline.models if isinstance(m, DFTD3Mesh)][0]
            transforms = list(sharded._mesh_transforms.values())
            sharing = {
                "transforms": len(transforms),
                "same_object": transforms == [pme._cached_kernel[1]] and pme._cached_kernel[1] is d3._cached_kernel[1],
                "box_maps": len(transforms[0]._boxmaps),
                "grid": transforms[0].grid,
            }
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, sharing)
        if dist.get_rank() != 0:
            continue
        result = differences(out, sum_of_parts(name, system))
        result["name"] = name
        if name == "pme_d3":
            result["sharing"] = gathered
        results.append(result)
    return results


@pytest.mark.timeout(240)
def test_composites_on_two_ranks_equal_the_sum_of_their_parts_and_share_the_mesh() -> None:
    import importlib.util

    names = ["pme_d3"] + (["mlip_d3"] if importlib.util.find_spec("mace") else [])
    results = spawn(composites_on_ranks, 2, names, timeout=220)[0]
    assert [r["name"] for r in results] == names
    for r in results:
        assert r["energy_rel"] <= 1e-12, r
        assert r["force"] <= 1e-10, r
        assert r["stress_rel"] <= 1e-12, r
        assert r["largest_force"] > 1e-3, r
        assert len(r["model_energies"]) >= 2 and "d3" in r["model_energies"], r
        for mine, theirs in r["model_energies"].values():
            assert abs(mine - theirs) <= 1e-12 * max(1.0, abs(theirs)), r
    # PME and DFTD3Mesh on one mesh shape: one transform object on every rank, one box map, one slab grid.
    sharing = results[0]["sharing"]
    assert sharing == [{"transforms": 1, "same_object": True, "box_maps": 1, "grid": (2, 1)}] * 2, sharing
