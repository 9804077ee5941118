"""Bring your own model: a plain torch module as a halopipe model.

Any ``torch.nn.Module`` that maps a graph to per-atom energies,

``module(numbers, pairs, vectors, n_nodes) -> energies (n_nodes,)``,

becomes a :class:`~halopipe.models.Model` with :class:`TorchModel`. Graph
convention (the halopipe one): ``pairs[0]`` is the centre ``i`` (the atom that
*receives*), ``pairs[1]`` the neighbour ``j`` and ``vectors = r_j - r_i``
(differentiable), one directed pair per ordered couple within ``cutoff``.
Forces and stress come from autograd through ``vectors``; the module must
not look at absolute positions.

How much of the neighbourhood the module needs decides the halo:

* ``layers=1`` (a local model, e.g. a descriptor + MLP): halo = ``cutoff``;
  the view's own pairs (owned centres) suffice.
* ``layers=L > 1`` without hooks: the module's energy of an atom depends on
  atoms up to ``L * cutoff`` away. The adapter asks for a *wide* halo
  ``L * cutoff``, gives the module every row as a centre and keeps the owned
  energies. Ghost features near the outer edge are wrong (cut
  neighbourhoods), but the error moves in one cutoff per layer and never
  reaches the owned rows.
* ``per_layer=True``: the module exposes three hooks,

  - ``embed(numbers) -> features (n_nodes, ...)`` (local: species only),
  - ``layer(k, features, numbers, pairs, vectors) -> features (n_nodes, ...)``,
    exact for every row that is a centre of ``pairs``,
  - ``readout(features, numbers) -> energies (n,)``;

  the adapter keeps the halo at one ``cutoff`` and after each layer replaces
  the ghost rows with their owners' features through ``view.refresh`` (a halo
  exchange under domain decomposition, differentiable). Far fewer ghosts are
  computed, at the price of one exchange per layer.

See ``examples/message_passing.py`` for a network implementing the hooks.
"""

from __future__ import annotations

import torch

from ..neighbors import owned_pairs, pair_vectors
from .base import LocalView, Model, ModelOutput, check_positive_length
from .compile import CompiledStages

__all__ = ["HOOKS", "TorchModel"]

#: Methods a module must have for per-layer (refreshed-halo) evaluation.
HOOKS = ("embed", "layer", "readout")


class TorchModel(Model):
    """A torch module computing per-atom energies from a graph, as a halopipe model.

    Parameters
    ----------
    module : ``module(numbers, pairs, vectors, n_nodes) -> (n_nodes,)`` per-atom
        energies (eV); with ``per_layer=True`` it must also have the hooks
        ``embed``, ``layer`` and ``readout`` (see the module docstring).
    cutoff : radius of the graph, Å.
    layers : number of message-passing layers (the receptive field is
        ``layers * cutoff``).
    per_layer : evaluate layer by layer with a halo of one ``cutoff`` and
        ghost features refreshed between layers (needs the hooks); otherwise
        a multi-layer module gets a wide halo ``layers * cutoff``.
    compile : run the module (or each hook) through ``torch.compile``
        (:mod:`halopipe.models.compile`); ``compile_kwargs`` go to it
        (``dynamic``, ``fullgraph``, ``mode``, ``options``).

    Notes
    -----
    Energies are cast to the dtype of the view's positions; the module is
    responsible for its own parameters' dtype (use ``module.double()`` with
    float64 systems).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        cutoff: float,
        layers: int = 1,
        per_layer: bool = False,
        compile: bool = False,
        compile_kwargs: dict | None = None,
    ) -> None:
        super().__init__()
        self.stages = CompiledStages("TorchModel")
        self.stages.enable(compile, compile_kwargs)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchModel: module must be a torch.nn.Module, got {type(module).__name__}")
        check_positive_length("TorchModel", "cutoff", cutoff)
        if int(layers) != layers or layers < 1:
            raise ValueError(f"TorchModel: layers must be a positive integer, got {layers}")
        missing = [h for h in HOOKS if not callable(getattr(module, h, None))]
        if per_layer and missing:
            raise ValueError(
                f"TorchModel: per_layer=True needs the module to define {list(HOOKS)}; {type(module).__name__} lacks {missing}"
            )
        self.module = module
        self.cutoff = float(cutoff)
        self.layers = int(layers)
        self.per_layer = bool(per_layer)

    @property
    def halo(self) -> float:
        return self.cutoff * (1 if self.per_layer else self.layers)

    @property
    def batchable(self) -> bool:
        """A whole batch in one view unless the wide-halo path searches its own pairs over all rows."""
        return self.per_layer or self.layers == 1

    @property
    def name(self) -> str:
        return type(self.module).__name__

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        if self.per_layer:
            energies = self._layer_by_layer(view)
        elif self.layers == 1:
            # Owned centres see complete neighbourhoods: the view's pairs suffice.
            energies = self.stages.run("module", self.module, view.numbers, view.pairs, view.vectors, view.n_rows)[: view.n_owned]
        else:
            # Every row is a centre so that ghosts get (partial) features of their own.
            pairs = owned_pairs(view.positions.detach(), view.n_rows, self.cutoff)
            vectors, _ = pair_vectors(view.positions, pairs)
            energies = self.stages.run("module", self.module, view.numbers, pairs, vectors, view.n_rows)[: view.n_owned]
        self._check(energies, view.n_owned)
        return ModelOutput(energies=energies.to(view.positions.dtype))

    def _layer_by_layer(self, view: LocalView) -> torch.Tensor:
        n, run = view.n_owned, self.stages.run
        features = run("embed", self.module.embed, view.numbers)  # local: ghosts need no refresh
        for k in range(self.layers):
            owned = run(f"layer{k}", self._layer_function(k), features, view.numbers, view.pairs, view.vectors)[:n]
            # Same refresh sequence on every rank (collective), none after the last layer.
            features = view.refresh(owned) if k + 1 < self.layers else owned
        return run("readout", self.module.readout, features, view.numbers[:n])

    def _layer_function(self, k: int):
        """The module's layer hook for layer ``k`` (its own compiled stage)."""
        return lambda features, numbers, pairs, vectors: self.module.layer(k, features, numbers, pairs, vectors)

    def _check(self, energies: torch.Tensor, n: int) -> None:
        if energies.shape != (n,):
            raise ValueError(
                f"TorchModel: {self.name} must return per-atom energies of shape (n_nodes,), got {tuple(energies.shape)} for {n} owned rows"
            )
