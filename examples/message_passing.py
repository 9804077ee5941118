"""A small message-passing network in plain torch, run through halopipe.

The network (:class:`MessagePassing`) knows nothing about halopipe: it maps a
graph (species, directed pairs ``(i, j)``, vectors ``r_j - r_i``) to per-atom
energies. Each layer mixes neighbour features with a smooth radial filter and
adds a three-body invariant (the squared norm of a vector message), so the
energy depends on angles as well as distances. It implements the per-layer
hooks ``embed`` / ``layer`` / ``readout``, so :class:`halopipe.models.TorchModel`
can run it with a halo of one cutoff and refresh ghost features between
layers, instead of a ghost shell ``layers * cutoff`` wide.

Run ``python examples/message_passing.py`` to compare both halo modes on a
small periodic system.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MessagePassing"]


class MessagePassing(torch.nn.Module):
    """Invariant message passing with a smooth cutoff.

    Parameters
    ----------
    cutoff : graph radius, Å.
    features : width of the node features.
    layers : number of message-passing layers.
    n_basis : radial basis functions.
    seed : initialisation seed (weights are random: this is an example).
    """

    def __init__(self, cutoff: float = 3.5, features: int = 8, layers: int = 2, n_basis: int = 6, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cutoff, self.n_layers, self.n_basis = float(cutoff), int(layers), int(n_basis)

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[0]))

        self.embedding = torch.nn.Parameter(torch.randn(119, features, generator=g))
        self.filters = torch.nn.ParameterList([param(n_basis, features) for _ in range(layers)])
        self.vector_filters = torch.nn.ParameterList([param(n_basis, features) for _ in range(layers)])
        self.mix = torch.nn.ParameterList([param(3 * features, features) for _ in range(layers)])
        self.out_hidden = param(features, features)
        self.out = param(features, 1)

    # ------------------------------------------------------------------ pieces
    def radial(self, r: torch.Tensor) -> torch.Tensor:
        """Sine basis times a cosine cutoff: smooth (C1) at the cutoff."""
        n = torch.arange(1, self.n_basis + 1, dtype=r.dtype, device=r.device)
        fc = 0.5 * (torch.cos(math.pi * r / self.cutoff) + 1.0)
        return torch.sin(n * math.pi * r[:, None] / self.cutoff) / r[:, None] * fc[:, None]

    # ------------------------------------------------------------------ hooks
    def embed(self, numbers: torch.Tensor) -> torch.Tensor:
        """Initial features from species only (local: ghosts need no refresh)."""
        return self.embedding[numbers]

    def layer(self, k: int, h: torch.Tensor, numbers: torch.Tensor, pairs: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        """One update; exact on every row that is a centre of ``pairs``."""
        i, j = pairs[0], pairs[1]
        r = vectors.norm(dim=1)
        basis = self.radial(r)
        scalar = (basis @ self.filters[k]) * h[j]  # (P, F)
        vector = ((basis @ self.vector_filters[k]) * h[j])[:, :, None] * (vectors / r[:, None])[:, None, :]  # (P, F, 3)
        m = h.new_zeros(h.shape).index_add(0, i, scalar)
        v = h.new_zeros(h.shape + (3,)).index_add(0, i, vector)
        update = torch.cat([h, m, (v * v).sum(-1)], dim=1) @ self.mix[k]
        return h + torch.nn.functional.silu(update)

    def readout(self, h: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        """Per-atom energies (n,)."""
        return (torch.nn.functional.silu(h @ self.out_hidden) @ self.out)[:, 0]

    # ------------------------------------------------------------------ plain call
    def forward(self, numbers: torch.Tensor, pairs: torch.Tensor, vectors: torch.Tensor, n_nodes: int) -> torch.Tensor:
        """Per-atom energies of all ``n_nodes`` nodes of a graph."""
        h = self.embed(numbers)
        for k in range(self.n_layers):
            h = self.layer(k, h, numbers, pairs, vectors)
        return self.readout(h, numbers)


def main() -> None:
    import ase.build

    from halopipe.models.adapter import TorchModel
    from halopipe.pipeline import Group, Pipeline, Step
    from halopipe.system import System

    atoms = ase.build.bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.05, seed=1)
    net = MessagePassing(cutoff=3.0, layers=3).double()
    system = System.from_ase(atoms)
    for per_layer in (True, False):
        model = TorchModel(net, cutoff=net.cutoff, layers=net.n_layers, per_layer=per_layer)
        out = Pipeline([Group([Step(model)], autograd=True)])(system, stress=True)
        print(
            f"per_layer={per_layer!s:5}  halo={model.halo:4.1f} Å  E={float(out['energy']):.10f} eV  "
            f"|F|max={float(out['forces'].abs().max()):.6f} eV/Å"
        )


if __name__ == "__main__":
    main()
