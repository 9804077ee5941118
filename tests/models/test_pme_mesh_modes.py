"""PME's two mesh paths on one process: the whole mesh and torch-pme's filter vs the box stencil and MeshTransform.

The replicated path spreads onto a full mesh and filters with torch-pme's
``KSpaceFilter``; the distributed path spreads onto the atoms'
support box, maps it through :class:`~halopipe.meshfft.LocalMeshTransform` and
builds the kernel from the transform's frequencies. Energy and its
derivatives in positions, charges (dE/dq) and cell must agree to rounding.
"""

from __future__ import annotations

import pytest
import torch

from halopipe.meshfft import LocalMeshTransform
from halopipe.models.base import LocalView
from halopipe.models.pme import PME

from ..conftest import random_ionic_cell

pytestmark = pytest.mark.timeout(120)


def _view(positions: torch.Tensor, cell: torch.Tensor, numbers: torch.Tensor) -> LocalView:
    n = positions.shape[0]
    empty = torch.zeros(0, 3, dtype=positions.dtype)
    return LocalView(
        positions=positions,
        numbers=numbers,
        n_owned=n,
        cell=cell,
        pbc=torch.tensor([True, True, True]),
        pairs=torch.zeros(2, 0, dtype=torch.int64),
        vectors=empty,
        distances=empty[:, 0],
        fields={},
        refresh=lambda x: x,
        global_sum=lambda x: x,
        n_total=n,
        ids=torch.arange(n),
        mesh_transform=lambda sizes, decomposition="auto": LocalMeshTransform(sizes),
    )


def _energy_and_gradients(pme: PME, system, path: str, shift: torch.Tensor):
    positions = (system.positions + shift).clone().requires_grad_(True)  # shift moves atoms out of the cell: boxes wrap
    cell = system.cell.clone().requires_grad_(True)
    q = system.fields["charges"].clone().requires_grad_(True)
    view = _view(positions, cell, system.numbers)
    sizes = pme.mesh(cell)
    if path == "replicated":
        energies = pme._reciprocal_replicated(view, q, sizes)
    else:
        energies = pme._reciprocal_distributed(view, q, LocalMeshTransform(sizes))
    energy = energies.sum()
    return (energy, *torch.autograd.grad(energy, (positions, q, cell)))


@pytest.mark.parametrize("order, sizes", [(3, (9, 10, 11)), (4, (12, 9, 10)), (5, (10, 15, 8))])
def test_box_stencil_path_equals_whole_mesh_path(order, sizes):
    system = random_ionic_cell(n_cells=3, seed=21, net_charge=0.3)
    pme = PME(cutoff=5.0, accuracy=1e-6, order=order, mesh_size=sizes)
    shift = torch.tensor([3.0, -7.5, 11.0], dtype=torch.float64)
    ref = _energy_and_gradients(pme, system, "replicated", shift)
    got = _energy_and_gradients(pme, system, "distributed", shift)
    assert abs(float(got[0] - ref[0])) < 1e-12 * abs(float(ref[0]))
    for name, g, r in zip(("dE/dr", "dE/dq", "dE/dcell"), got[1:], ref[1:]):
        assert float((g - r).abs().max()) < 1e-11 * float(r.abs().max()), name


def test_atoms_in_a_corner_use_a_small_box():
    """Atoms clustered near one mesh corner spread onto a box much smaller than the mesh (memory O(box))."""
    from halopipe.models.pme import _Stencil

    cell = torch.eye(3, dtype=torch.float64) * 20.0
    positions = torch.tensor([[0.5, 0.5, 0.5], [19.6, 1.0, 0.2], [1.5, 19.0, 19.9]], dtype=torch.float64)
    stencil = _Stencil(cell, positions, (40, 40, 40), 4)
    assert all(e <= 8 for e in stencil.extent), stencil.extent  # 2 Å of atoms (4 points) plus the 4-point support


class _Parts:
    def __init__(self, parts: int, sizes) -> None:
        self.parts, self.sizes = parts, sizes


def test_auto_mode_follows_the_measured_crossover():
    pme = PME(cutoff=5.0, mesh="auto")
    assert not pme._distributes(_Parts(1, (128, 128, 128)))
    assert not pme._distributes(_Parts(2, (48, 48, 48))) and pme._distributes(_Parts(2, (64, 64, 64)))
    assert not pme._distributes(_Parts(4, (24, 24, 24))) and pme._distributes(_Parts(4, (32, 32, 32)))
    assert PME(cutoff=5.0, mesh="distributed")._distributes(_Parts(1, (8, 8, 8)))
    assert not PME(cutoff=5.0, mesh="replicated")._distributes(_Parts(8, (128, 128, 128)))
    assert all(PME(cutoff=5.0, mesh=forced)._distributes(_Parts(2, (8, 8, 8))) for forced in ("slab", "pencil"))


def test_unknown_mesh_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="mesh must be one of"):
        PME(cutoff=5.0, mesh="cubes")


def test_config_schema_offers_every_mesh_mode():
    from typing import get_args

    from halopipe.config.models import PMESpec
    from halopipe.models.pme import _MESH_MODES

    literal = next(a for a in get_args(PMESpec.model_fields["mesh"].annotation) if a is not type(None))
    assert set(get_args(literal)) == set(_MESH_MODES)
