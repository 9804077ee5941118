"""MACE message-passing potentials on a local view, with a halo of one cutoff.

A MACE model with ``L`` interaction layers and cutoff ``r_max`` makes atom
``i``'s energy depend on atoms up to ``L * r_max`` away: layer ``t`` mixes the
features of each atom's neighbours from layer ``t - 1``. The naive way to run
it on a domain is a ghost shell ``L * r_max`` wide, recomputing every layer on
every ghost (``halo_mode="wide"``). The ghost count grows as the cube of the
width, so for ``L = 2..3`` most of the work is wasted on ghosts.

``halo_mode="layer"`` (the default) instead keeps the halo at ``r_max`` and
*refreshes* the ghost rows between layers: after interaction + product of
layer ``t`` the new features are exact only on owned rows (their neighbour
lists are complete), so the ghost rows are overwritten with their owners'
values by ``view.refresh`` before layer ``t + 1``. Layer 0 needs no refresh:
the embedding depends on the species alone. Backward sends ghost gradients
home through the same refresh, so forces and stress remain exact.

Graph convention (mace-torch): ``edge_index[0]`` is the *sender* ``j``,
``edge_index[1]`` the *receiver* ``i`` and the edge vector is
``r_receiver - r_sender``; messages are summed into receivers. A view pair
``(i, j)`` (owned centre ``i``, vector ``r_j - r_i``) is therefore the MACE
edge ``j -> i`` with vector ``-(r_j - r_i)``.

The model's own modules do all the physics (embedding, spherical harmonics,
radial basis, interactions, products, readouts, E0s, ZBL pair repulsion and
the ScaleShiftMACE scale/shift); this file only decides which rows and edges
they see. Requires the ``[mace]`` extra (``mace-torch``).

With ``compile=True`` the stages run a copy of the model rebuilt with e3nn's
TorchScript code generation off (:func:`_traceable_copy`, as mace-torch's own
compile path does): dynamo cannot trace TorchScript, so the original's e3nn
layers would break every compiled graph into pieces that inductor cannot fuse.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..neighbors import row_centred_pairs
from .base import LocalView, Model, ModelOutput, check_positive_length, default_dtype
from .compile import CompiledStages

__all__ = ["MACE"]

_HALO_MODES = ("layer", "wide")
# The attributes of mace.modules.MACE that this wrapper drives (block call signatures as of mace-torch 0.3.16).
_REQUIRED = (
    "atomic_numbers",
    "r_max",
    "node_embedding",
    "spherical_harmonics",
    "radial_embedding",
    "interactions",
    "products",
    "readouts",
    "atomic_energies_fn",
)


def _model_dtype(module: torch.nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _check_supported(module: torch.nn.Module) -> None:
    """Reject what cannot be evaluated from positions and species alone."""
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError("MACE: TorchScript (compiled) models are not supported; load the original .model file saved with torch.save")
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    if missing:
        raise ValueError(
            f"MACE: {type(module).__name__} is not a mace-torch energy model (missing {missing}); "
            "pass a mace.modules.MACE or ScaleShiftMACE"
        )
    if hasattr(module, "joint_embedding"):
        raise ValueError(
            "MACE: models with a joint embedding of per-structure inputs (embedding_specs, e.g. total charge or spin) are not supported"
        )


def _product_on_rows(product, node_feats, sc, attrs, rows):
    """The product block on every row (``rows`` None: the wide halo) or on ``rows`` only (the owned rows, layer mode)."""
    if rows is None:
        return _product(product, node_feats, sc, attrs)
    return _product(product, node_feats[rows], None if sc is None else sc[rows], attrs[rows])


def _product(product: torch.nn.Module, node_feats: torch.Tensor, sc: torch.Tensor | None, attrs: torch.Tensor) -> torch.Tensor:
    """mace's product block on some rows, also on none (a rank that owns no atoms).

    mace's symmetric contraction cannot reshape a tensor of zero rows, so zero
    rows are padded with one zero row whose output is dropped. The padding is
    appended to the (empty) inputs rather than made afresh, so the result stays
    on the inputs' graph: the backward pass then still runs through every
    refresh of this rank, and its halo exchanges meet their peers'.
    """
    if node_feats.shape[0] > 0:
        return product(node_feats=node_feats, sc=sc, node_attrs=attrs)

    def pad(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])

    padded_attrs = pad(attrs)
    padded_attrs[0, 0] = 1.0  # a valid one-hot species for the padding row
    return product(node_feats=pad(node_feats), sc=pad(sc), node_attrs=padded_attrs)[:0]


def _embedding_function(m: torch.nn.Module):
    """The embedding stage of network ``m``: edge attributes and features, cutoff envelope, edge lengths, first node features."""

    def embedding(vectors: torch.Tensor, attrs: torch.Tensor, edge_index: torch.Tensor) -> tuple:
        lengths = vectors.norm(dim=-1, keepdim=True)
        edge_attrs = m.spherical_harmonics(vectors)
        edge_feats, cutoff = m.radial_embedding(lengths, attrs, edge_index, m.atomic_numbers)
        return edge_attrs, edge_feats, cutoff, lengths, m.node_embedding(attrs)

    return embedding


def _placement(module: torch.nn.Module) -> tuple:
    """Device and dtype of a module's weights."""
    return next(module.parameters()).device, _model_dtype(module)


def _traceable_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` rebuilt from its configuration with e3nn's TorchScript code generation off, same weights.

    e3nn builds its ``Linear`` and ``TensorProduct`` layers as TorchScript,
    which dynamo cannot trace: a compiled MACE then breaks its graphs at every
    such layer and gains nothing (measured: 1.0x eager on a 128-channel model;
    the rebuilt copy compiled runs in 0.59x). mace-torch's compile path
    rebuilds the model the same way (``mace.tools.compile.prepare``). A model
    mace-torch cannot rebuild keeps its layers, with one warning naming why.

    The copy is built with the model's dtype as torch's default: a float64
    model's copy built under torch's float32 default gave compiled results
    off by 9e-9 relative (a 27-atom energy), although ``load_state_dict``
    and ``.to(dtype)`` followed. Eager, the two copies give identical
    numbers; what differs shows only when compiled and was not located.
    """
    device, dtype = _placement(module)
    try:
        from mace.tools.compile import disable_e3nn_codegen
        from mace.tools.scripts_utils import extract_config_mace_model

        config = extract_config_mace_model(module)
        if "error" in config:
            raise TypeError(config["error"])
        with disable_e3nn_codegen(), default_dtype(dtype):
            copy = type(module)(**config)
        copy.load_state_dict(module.state_dict(), strict=True)  # every weight, or the fallback below
    except Exception as exc:  # a model mace-torch cannot rebuild: compile around its TorchScript layers
        warnings.warn(
            f"MACE: compile=True could not rebuild the model without e3nn's TorchScript layers ({type(exc).__name__}: {exc}); "
            "compiling the original, whose e3nn layers stay uncompiled (slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        return module
    return copy.to(device=device, dtype=dtype).train(module.training)


EDGE_SLICES = 4
"""With ``checkpoint=True``, each layer's messages are summed over this many slices of its edges (see ``_sliced_layer``)."""


def _edge_sum_blocks() -> tuple[type, type]:
    """mace's interaction blocks whose message is a sum over edges: (residual, plain).

    Both compute ``linear(scatter_sum(tp(edges)))`` (the plain one then takes a tensor product with the node
    attributes, linear in the message); density-normalised and nonlinear blocks are not sums over edges.
    """
    from mace.modules.blocks import RealAgnosticInteractionBlock, RealAgnosticResidualInteractionBlock

    return RealAgnosticResidualInteractionBlock, RealAgnosticInteractionBlock


def _sums_over_edges(interaction: torch.nn.Module) -> bool:
    """Whether the interaction's message is a sum over its edges (:func:`_edge_sum_blocks`, without a fused kernel)."""
    return type(interaction) in _edge_sum_blocks() and not hasattr(interaction, "conv_fusion")


class MACE(Model):
    """A mace-torch model (``mace.modules.MACE`` / ``ScaleShiftMACE``) as a halopipe model.

    Parameters
    ----------
    module : the loaded mace-torch model. Its parameters keep their dtype: the
        view's geometry is cast to it and energies are cast back.
    halo_mode : ``"layer"`` (halo ``r_max``, ghost features refreshed between
        layers) or ``"wide"`` (halo ``num_interactions * r_max``, every layer
        computed on every row, no communication between layers; for comparison).
    head : name of the readout head of a multi-head model (default: the only
        head, or the one called ``"Default"``).
    compile : run the local pieces of the forward pass (edge embedding, each
        layer) through ``torch.compile`` (:mod:`halopipe.models.compile`);
        ``compile_kwargs`` go to it (``dynamic``, ``fullgraph``, ``mode``, ``options``).
    checkpoint : recompute each layer's activations in the backward pass
        instead of keeping them (less memory, one more forward pass of the layers).
        For mace's agnostic interaction blocks the messages are also summed over
        :data:`EDGE_SLICES` slices of the edges, each recomputed on its own, so the
        backward holds one slice's edge tensors and their gradients at a time.

    Notes
    -----
    In wide mode the wrapper builds its own edge list with every row as a
    centre, since the view only lists pairs centred on owned rows. Features of
    ghosts near the outer edge of the halo are wrong (their neighbourhoods are
    cut), but the error travels inwards by one ``r_max`` per layer, so it never
    reaches owned atoms after ``L`` layers of a halo ``L * r_max`` wide.
    """

    own_dtype = True  # runs at its weights' dtype; a run's precision does not cast them

    def __init__(
        self,
        module: torch.nn.Module,
        halo_mode: str = "layer",
        head: str | None = None,
        compile: bool = False,
        compile_kwargs: dict | None = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.stages = CompiledStages("MACE", checkpoint)
        self.stages.enable(compile, compile_kwargs)
        _check_supported(module)
        if halo_mode not in _HALO_MODES:
            raise ValueError(f"MACE: halo_mode must be one of {_HALO_MODES}, got {halo_mode!r}")
        self.module = module
        self.halo_mode = halo_mode
        self.cutoff = check_positive_length("MACE", "the model's r_max", module.r_max)
        self.num_layers = len(module.interactions)
        self.head_index = self._head_index(module, head)
        self.species = [int(z) for z in module.atomic_numbers]
        index = torch.full((119,), -1, dtype=torch.int64)
        index[module.atomic_numbers.cpu()] = torch.arange(len(self.species))
        self.register_buffer("species_index", index.to(module.atomic_numbers.device), persistent=False)
        self._traceable: list[torch.nn.Module] = []  # the compiled stages' copy of module (a list: not a submodule)

    @staticmethod
    def _head_index(module: torch.nn.Module, head: str | None) -> int:
        heads = list(getattr(module, "heads", None) or ["Default"])
        if head is None:
            if len(heads) == 1:
                return 0
            default = [k for k, h in enumerate(heads) if h.lower() == "default"]
            if not default:
                raise ValueError(f"MACE: the model has several heads {heads}; choose one with head=...")
            return default[0]
        if head not in heads:
            raise ValueError(f"MACE: unknown head {head!r}; the model has heads {heads}")
        return heads.index(head)

    @classmethod
    def from_file(cls, path: str | Path, map_location: str | torch.device | None = "cpu", **kwargs) -> MACE:
        """Load a model saved by mace-torch (``torch.save`` of the module).

        The file is unpickled (``weights_only=False``): load only files you
        trust. It is loaded onto ``map_location`` (CPU by default, so that
        files saved on a GPU load anywhere); move the model with ``.to(device)``.
        ``kwargs`` go to the constructor (``halo_mode``, ``head``, ``compile``, ...).
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"MACE.from_file: no such file {str(path)!r}")
        module = torch.load(path, map_location=map_location, weights_only=False)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"MACE.from_file: {str(path)!r} holds a {type(module).__name__}, not a model; save the model with torch.save(model, path)"
            )
        return cls(module, **kwargs)

    @property
    def batchable(self) -> bool:
        """A whole batch in one view in layer mode; wide mode searches its own pairs over all rows (per system then)."""
        return self.halo_mode == "layer"

    @property
    def halo(self) -> float:
        return self.cutoff * (self.num_layers if self.halo_mode == "wide" else 1)

    @property
    def dtype(self) -> torch.dtype:
        return _model_dtype(self.module)

    # ------------------------------------------------------------------ helpers
    @property
    def network(self) -> torch.nn.Module:
        """The module the stages run: ``module``, or with ``compile=True`` its traceable copy (:func:`_traceable_copy`).

        The copy is made at the first compiled evaluation and again when
        ``module`` has moved to another device or dtype since.
        """
        if not self.stages.enabled:
            return self.module
        if not self._traceable or _placement(self._traceable[0]) != _placement(self.module):
            self._traceable[:] = [_traceable_copy(self.module)]
            self.stages.enable(True, self.stages.options)  # drop stages compiled around a previous copy
        return self._traceable[0]

    def node_attrs(self, numbers: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """One-hot species encoding in the model's element order."""
        idx = self.species_index[numbers]
        if bool((idx < 0).any()):
            bad = sorted({int(z) for z in numbers[idx < 0].tolist()})
            raise ValueError(f"MACE: element(s) {bad} are not in the model's atomic_numbers {self.species}; use a model trained on them")
        return torch.nn.functional.one_hot(idx, len(self.species)).to(dtype)

    def _graph(self, view: LocalView, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """MACE edge_index (sender, receiver) and edge vectors r_receiver - r_sender."""
        if self.halo_mode == "wide":
            pairs, vectors = row_centred_pairs(view.positions, self.cutoff)
        else:
            pairs, vectors = view.pairs, view.vectors
        return torch.stack([pairs[1], pairs[0]]), -vectors.to(dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        n = view.n_owned
        dtype = self.dtype
        attrs = self.node_attrs(view.numbers, dtype)
        edge_index, vectors = self._graph(view, dtype)
        owned = torch.arange(n, device=attrs.device)  # owned rows by index inside stages: a new count needs no recompile
        run = self.stages.run  # local pieces, compiled with compile=True; refreshes stay eager between them
        network = self.network  # resolved eagerly: making the traceable copy is no work for a compiled stage
        edge_attrs, edge_feats, cutoff, lengths, node_feats = run("embedding", _embedding_function(network), vectors, attrs, edge_index)
        per_layer = []
        for k in range(self.num_layers):
            if self.stages.checkpoint and _sums_over_edges(network.interactions[k]):
                node_feats = self._sliced_layer(network, k, attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff, owned)
            else:
                layer = self._layer_function(network, k)
                node_feats = run(f"layer{k}", layer, attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff, owned, recompute=True)
            if self.halo_mode == "wide":
                per_layer.append(node_feats[:n])
            else:
                # Only owned receivers have complete neighbourhoods: the layer finished on them, ghosts take their owners' values.
                per_layer.append(node_feats)
                if k + 1 < self.num_layers:
                    node_feats = view.refresh(node_feats)
        energies = self._energies(n, attrs, per_layer, edge_index, lengths)
        return ModelOutput(energies=energies.to(view.positions.dtype))

    def _layer_function(self, network: torch.nn.Module, k: int):
        """Layer ``k``: interaction on every row, then the product (on the owned rows, selected by ``owned``, in layer mode)."""
        interaction, product, wide = network.interactions[k], network.products[k], self.halo_mode == "wide"

        def layer(attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff, owned):
            node_feats, sc = interaction(
                node_attrs=attrs,
                node_feats=node_feats,
                edge_attrs=edge_attrs,
                edge_feats=edge_feats,
                edge_index=edge_index,
                cutoff=cutoff,
                first_layer=(k == 0),
            )
            return _product_on_rows(product, node_feats, sc, attrs, None if wide else owned)

        return layer

    def _sliced_layer(self, network, k, attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff, owned) -> torch.Tensor:
        """Layer ``k`` with ``checkpoint=True``: its messages summed over :data:`EDGE_SLICES` slices of the edges.

        Each slice's messages and the product are checkpointed stages of their own, so the backward pass holds
        one slice's edge tensors and their gradients at a time (most of a layer's memory) instead of all of them.
        Exact: the interaction is linear in its edges (:func:`_sums_over_edges`).
        """
        interaction, product, wide = network.interactions[k], network.products[k], self.halo_mode == "wide"

        def messages(attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff):
            kwargs = {"edge_attrs": edge_attrs, "edge_feats": edge_feats, "edge_index": edge_index, "cutoff": cutoff}
            return interaction(node_attrs=attrs, node_feats=node_feats, first_layer=(k == 0), **kwargs)[0]

        def produce(attrs, node_feats, message, owned):
            sc = interaction.skip_tp(node_feats, attrs) if type(interaction) is _edge_sum_blocks()[0] else None
            return _product_on_rows(product, message, sc, attrs, None if wide else owned)

        run, total = self.stages.run, None
        size = max(-(-edge_index.shape[1] // EDGE_SLICES), 1)
        for start in range(0, max(edge_index.shape[1], 1), size):
            part = slice(start, start + size)
            envelope = None if cutoff is None else cutoff[part]
            edges = (edge_attrs[part], edge_feats[part], edge_index[:, part], envelope)
            sliced = run(f"messages{k}", messages, attrs, node_feats, *edges, recompute=True)
            total = sliced if total is None else total + sliced
        return run(f"product{k}", produce, attrs, node_feats, total, owned, recompute=True)

    def _energies(
        self, n: int, attrs: torch.Tensor, per_layer: list[torch.Tensor], edge_index: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """E0 + (pair repulsion + readouts), scaled/shifted as ScaleShiftMACE does, owned rows only."""
        m = self.module
        rows = torch.arange(n, device=attrs.device)
        head = torch.full((n,), self.head_index, dtype=torch.int64, device=attrs.device)
        e0 = m.atomic_energies_fn(attrs[:n])[rows, head]
        inter = torch.zeros(n, dtype=e0.dtype, device=e0.device)
        if hasattr(m, "pair_repulsion"):
            # ZBL sums edge terms into receivers: exact on owned rows.
            inter = inter + m.pair_repulsion_fn(lengths, attrs, edge_index, m.atomic_numbers)[:n]
        for k, readout in enumerate(m.readouts):
            feats = per_layer[-1 if len(m.readouts) == 1 else k]
            inter = inter + readout(feats, head)[rows, head]
        if hasattr(m, "scale_shift"):
            inter = m.scale_shift(inter, head)
        return e0.to(inter.dtype) + inter
