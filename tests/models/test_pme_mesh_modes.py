"""PME's two mesh paths on one process, and its hand-written backward against an autograd chain.

The replicated path spreads onto a full mesh; the distributed path spreads
onto the atoms' support box and maps it through
:class:`~halopipe.meshfft.LocalMeshTransform`. Energy and its derivatives in
positions, charges (dE/dq) and cell must agree to rounding. Both reuse the
forward's potential in the backward when the energies are summed, and run
the exact adjoint for weighted shares; both are checked against autograd
through the differentiable spreading kernels and torch-pme's ``KSpaceFilter``.
"""

from __future__ import annotations

import pytest
import torch
from torchpme.lib import KSpaceFilter, KSpaceKernel

from halopipe.kernels.mesh import SplineBox, interpolate_mesh, mesh_coordinates, spread_charges, support_start
from halopipe.meshfft import LocalMeshTransform
from halopipe.models.base import LocalView
from halopipe.models.pme import PME, _reciprocal_shares, bspline_influence, spme_kernel

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


def _reciprocal_energies(pme: PME, view, q: torch.Tensor, path: str) -> torch.Tensor:
    """The owned reciprocal energies through the whole mesh (``"replicated"``) or a box of it (``"distributed"``)."""
    sizes = pme.mesh(view.cell)
    if path == "replicated":
        stencil, convolution, kernel = pme._replicated_pieces(view, sizes)
    else:
        stencil, convolution, kernel = pme._distributed_pieces(view, LocalMeshTransform(sizes))
    return _reciprocal_shares(stencil.u, q, kernel, stencil, convolution, view.global_sum)[0]


def _energy_and_gradients(pme: PME, system, path: str, shift: torch.Tensor):
    positions = (system.positions + shift).clone().requires_grad_(True)  # shift moves atoms out of the cell: boxes wrap
    cell = system.cell.clone().requires_grad_(True)
    q = system.fields["charges"].clone().requires_grad_(True)
    view = _view(positions, cell, system.numbers)
    energy = _reciprocal_energies(pme, view, q, path).sum()
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
    from halopipe.models.particle_mesh import Stencil

    cell = torch.eye(3, dtype=torch.float64) * 20.0
    positions = torch.tensor([[0.5, 0.5, 0.5], [19.6, 1.0, 0.2], [1.5, 19.0, 19.9]], dtype=torch.float64)
    stencil = Stencil(cell, positions, (40, 40, 40), 4)
    assert all(e <= 8 for e in stencil.extent), stencil.extent  # 2 Å of atoms (4 points) plus the 4-point support


class _Parts:
    def __init__(self, parts: int, sizes) -> None:
        self.parts, self.sizes = parts, sizes


def test_auto_mode_follows_the_measured_crossover():
    pme = PME(cutoff=5.0, mesh="auto")
    assert not pme._distributes(_Parts(1, (128, 128, 128)))
    assert not pme._distributes(_Parts(2, (32, 32, 32))) and pme._distributes(_Parts(2, (40, 40, 40)))
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


# ------------------------------------------------- backward against autograd
class _TorchPMEKernel(KSpaceKernel):
    def __init__(self, pme: PME, cell: torch.Tensor, sizes) -> None:
        super().__init__()
        self.alpha, self.volume = pme.alpha, torch.linalg.det(cell).abs()
        b = [bspline_influence(n, pme.order, axis == 2, cell.dtype, "cpu") for axis, n in enumerate(sizes)]
        self.influence = b[0][:, None, None] * b[1][None, :, None] * b[2][None, None, :]

    def kernel_from_k_sq(self, k_sq: torch.Tensor) -> torch.Tensor:
        return spme_kernel(k_sq, self.alpha, self.volume, self.influence)


def _autograd_shares(pme: PME, positions: torch.Tensor, cell: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q_i phi_i / 2`` by autograd: differentiable spreading kernels, torch-pme's k-space filter, interpolation."""
    sizes = pme.mesh(cell)
    u = mesh_coordinates(positions, cell, sizes)
    first, box = support_start(u, pme.order), SplineBox(pme.order, sizes)
    kfilter = KSpaceFilter(cell, torch.tensor(sizes), _TorchPMEKernel(pme, cell, sizes), fft_norm="backward", ifft_norm="forward")
    potential = kfilter(spread_charges(u, q, first, box)[None])[0]
    return 0.5 * q * interpolate_mesh(u, potential, first, box)


@pytest.mark.parametrize("path", ["replicated", "distributed"])
@pytest.mark.parametrize("weights", ["summed", "per_atom"])
def test_backward_equals_autograd_through_the_mesh(path, weights):
    """Summed shares (the forward's potential reused) and weighted shares (the exact adjoint) give autograd's gradients."""
    system = random_ionic_cell(n_cells=3, seed=5, net_charge=0.2)
    pme = PME(cutoff=5.0, accuracy=1e-6, order=4, mesh_size=(12, 10, 11))
    g = torch.Generator().manual_seed(3)
    w = torch.ones(system.n_atoms, dtype=torch.float64)
    if weights == "per_atom":
        w = 0.5 + torch.rand(system.n_atoms, generator=g, dtype=torch.float64)

    def weighted(fn):
        positions = system.positions.clone().requires_grad_(True)
        cell = system.cell.clone().requires_grad_(True)
        q = system.fields["charges"].clone().requires_grad_(True)
        total = (w * fn(positions, cell, q)).sum()
        return (total, *torch.autograd.grad(total, (positions, q, cell)))

    def model(positions, cell, q):
        return _reciprocal_energies(pme, _view(positions, cell, system.numbers), q, path)

    ref = weighted(lambda positions, cell, q: _autograd_shares(pme, positions, cell, q))
    got = weighted(model)
    assert abs(float(got[0] - ref[0])) < 1e-12 * abs(float(ref[0]))
    for name, a, b in zip(("dL/dr", "dL/dq", "dL/dcell"), got[1:], ref[1:]):
        assert float((a - b).abs().max()) < 1e-11 * float(b.abs().max()), name
