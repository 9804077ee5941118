"""SevenNet pretrained potentials on a local view, with a halo of one cutoff.

SevenNet (``sevenn``) is a NequIP-style equivariant message-passing network:
an embedding of the species, then ``L`` interaction layers (self-connection,
linear, convolution over the edges within ``cutoff``, linear, gate), then a
per-atom readout, scaled and shifted per species. Like MACE (see
:mod:`halopipe.models.mace`) an atom's energy depends on atoms ``L * cutoff``
away; SevenNet-0 has five layers and a 5 Å cutoff, so that is 25 Å.

``halo_mode="layer"`` (the default) keeps the halo at one cutoff. In each layer
every row sends messages (its features are exact at the layer's start), but
only owned rows receive a complete neighbourhood, so the modules after the
convolution run on owned rows only, and ``view.refresh`` copies the owners'
new features into the ghost rows before the next layer. The embedding needs no
refresh (it depends on the species alone). ``halo_mode="wide"`` runs every
layer on every row, each row a centre, with a halo of ``L * cutoff``: errors of
ghosts near the edge travel inwards one cutoff per layer and never reach owned
atoms (for comparison; it costs far more ghosts).

Graph convention (sevenn): ``edge_index[0]`` is the receiving centre ``i``,
``edge_index[1]`` the sender ``j``, and the edge vector is ``r_j - r_i``: the
view's owned-centred pairs as they are. The checkpoint's own modules do all the
physics; this file decides which rows and edges they see, and skips sevenn's
total-energy sum and force/stress module (halopipe differentiates the energy).
Requires the ``[sevenn]`` extra (``sevenn``, which needs ``e3nn >= 0.5`` and so
cannot share an environment with ``mace-torch 0.3.16``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..neighbors import row_centred_pairs
from .base import LocalView, Model, ModelOutput, default_dtype
from .compile import CompiledStages

__all__ = ["SevenNet"]

_HALO_MODES = ("layer", "wide")
# sevenn modules that compute totals, forces or stress: halopipe does those itself.
_SKIPPED = frozenset({"AtomReduce", "ForceOutput", "ForceStressOutput", "ForceStressOutputFromEdge"})
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _keys():
    import sevenn._keys as KEY

    return KEY


def _node_keys() -> tuple[str, ...]:
    """Data entries holding one row per atom (sliced to owned rows after a convolution)."""
    KEY = _keys()
    return (KEY.NODE_FEATURE, KEY.NODE_ATTR, KEY.ATOM_TYPE, KEY.ATOMIC_NUMBERS, KEY.SELF_CONNECTION_TEMP)


def load_sevennet(model: str | Path) -> torch.nn.Module:
    """Build a sevenn model from a pretrained name (``"7net-0"``, ...) or a checkpoint file.

    Raises ``ValueError`` naming the ``model`` key and the shipped names when
    ``model`` is neither.
    """
    try:
        import sevenn.util
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("SevenNet needs the sevenn package: pip install 'halopipe[sevenn]'") from exc
    try:
        checkpoint = sevenn.util.load_checkpoint(str(model))
    except (ValueError, FileNotFoundError) as exc:
        names = ", ".join(sevenn.util.get_available_pretrained_models())
        raise ValueError(
            f"SevenNet: model={str(model)!r} is neither a checkpoint file nor a pretrained name; use a path to a .pth "
            f"checkpoint or one of: {names} (7net-0, 7net-0_22may2024, 7net-l3i5 and 7net-mf-0 ship with the wheel)"
        ) from exc
    with default_dtype(torch.float32):  # sevenn builds (and checks) its float32 weights under the default dtype
        module = checkpoint.build_model()
    module.requires_grad_(False)  # inference only: no parameter gradients in the backward pass
    return module


def _split_layers(module: torch.nn.Module) -> tuple[list, list[tuple[list, torch.nn.Module, list]], list]:
    """Embedding modules, per layer (before-convolution, convolution, after), readout modules."""
    named = list(module._modules.items())
    layer_of = {}
    for name, _ in named:
        head = name.split("_", 1)[0]
        if head.isdigit():
            layer_of[name] = int(head)
    if not layer_of:
        raise ValueError(f"SevenNet: {type(module).__name__} has no numbered interaction layers ('0_convolution', ...)")
    first = min(i for i, (name, _) in enumerate(named) if name in layer_of)
    last = max(i for i, (name, _) in enumerate(named) if name in layer_of)
    embedding = [m for _, m in named[:first]]
    readout = [m for _, m in named[last + 1 :] if type(m).__name__ not in _SKIPPED]
    layers = []
    for k in range(max(layer_of.values()) + 1):
        mods = [(name, m) for name, m in named if layer_of.get(name) == k]
        convs = [i for i, (name, _) in enumerate(mods) if name.endswith("convolution")]
        if len(convs) != 1:
            raise ValueError(f"SevenNet: layer {k} must hold exactly one convolution, found {len(convs)}")
        c = convs[0]
        layers.append(([m for _, m in mods[:c]], mods[c][1], [m for _, m in mods[c + 1 :]]))
    return embedding, layers, readout


class SevenNet(Model):
    """A SevenNet potential (``sevenn``) as a halopipe model.

    Parameters
    ----------
    model : pretrained name shipped with sevenn (``"7net-0"``, ``"7net-l3i5"``,
        ``"7net-mf-0"``, ...), a path to a sevenn checkpoint (``.pth``), or an
        already built ``sevenn`` ``AtomGraphSequential``.
    modal : fidelity of a multi-fidelity model (for ``7net-mf-0``: ``"PBE"`` or
        ``"R2SCAN"``; case-insensitive); must be ``None`` for the others.
    halo_mode : ``"layer"`` (halo one cutoff, ghost features refreshed between
        layers) or ``"wide"`` (halo ``layers * cutoff``, no refresh; for comparison).
    dtype : ``"float32"`` or ``"float64"`` (the weights cast, in place for a
        passed module); ``None`` keeps the module's dtype (float32 for the
        shipped checkpoints). Positions are cast to it and energies cast back
        to the system's dtype.
    compile : run the embedding, each layer and the readout through
        ``torch.compile`` (:mod:`halopipe.models.compile`); ``compile_kwargs``
        go to it (``dynamic``, ``fullgraph``, ``mode``, ``options``).
    checkpoint : recompute each layer's activations in the backward pass
        instead of keeping them (less memory, one more forward pass of the layers).

    Examples
    --------
    >>> from halopipe import DFTD3, Group, Pipeline, SevenNet, Step
    >>> pipeline = Pipeline([Group([Step(SevenNet("7net-0")), Step(DFTD3("pbe"))])])  # doctest: +SKIP
    """

    own_dtype = True  # runs at its weights' dtype; a run's precision does not cast them

    def __init__(
        self,
        model: str | Path | torch.nn.Module = "7net-0",
        modal: str | None = None,
        halo_mode: str = "layer",
        dtype: str | torch.dtype | None = None,
        compile: bool = False,
        compile_kwargs: dict | None = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.stages = CompiledStages("SevenNet", checkpoint)
        self.stages.enable(compile, compile_kwargs)
        if halo_mode not in _HALO_MODES:
            raise ValueError(f"SevenNet: halo_mode must be one of {_HALO_MODES}, got {halo_mode!r}")
        module = model if isinstance(model, torch.nn.Module) else load_sevennet(model)
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError("SevenNet: TorchScript (deployed) models are not supported; pass the checkpoint (.pth) instead")
        if not hasattr(module, "type_map") or not module.type_map:
            raise ValueError(
                f"SevenNet: {type(module).__name__} has no type_map; pass a sevenn AtomGraphSequential built from a checkpoint"
            )
        module.set_is_batch_data(False)  # one structure: per-structure inputs (modality) are scalars
        self.module = module.eval()
        if dtype is not None:
            self.module.to(_resolve_dtype(dtype))
        self.halo_mode = halo_mode
        self.cutoff = float(module.cutoff)
        if not self.cutoff > 0:
            raise ValueError(f"SevenNet: the model's cutoff must be positive, got {self.cutoff}")
        self.embedding, self.layers, self.readout = _split_layers(module)
        self.num_layers = len(self.layers)
        self.modal_index = _modal_index(module, modal)
        self.species = sorted(int(z) for z in module.type_map)
        index = torch.full((119,), -1, dtype=torch.int64)
        for z, i in module.type_map.items():
            index[int(z)] = int(i)
        self.register_buffer("species_index", index, persistent=False)

    @property
    def batchable(self) -> bool:
        """A whole batch in one view in layer mode; wide mode searches its own pairs over all rows (per system then)."""
        return self.halo_mode == "layer"

    @property
    def halo(self) -> float:
        return self.cutoff * (self.num_layers if self.halo_mode == "wide" else 1)

    @property
    def dtype(self) -> torch.dtype:
        for p in self.module.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    # ------------------------------------------------------------------ helpers
    def type_indices(self, numbers: torch.Tensor) -> torch.Tensor:
        """The model's species index of each atomic number; clear error for unknown elements."""
        idx = self.species_index[numbers]
        if bool((idx < 0).any()):
            bad = sorted({int(z) for z in numbers[idx < 0].tolist()})
            raise ValueError(
                f"SevenNet: element(s) {bad} are not known to the model (it knows Z = {self.species}); use a model trained on them"
            )
        return idx

    def _graph(self, view: LocalView, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """sevenn edge_index (centre, neighbour) and edge vectors r_neighbour - r_centre."""
        if self.halo_mode == "wide":
            pairs, vectors = row_centred_pairs(view.positions, self.cutoff)
        else:
            pairs, vectors = view.pairs, view.vectors
        return pairs, vectors.to(dtype)

    def _inputs(self, view: LocalView, dtype: torch.dtype) -> dict:
        """The graph as sevenn data: species indices (checked here, eagerly), edges and the modality."""
        KEY = _keys()
        edge_index, vectors = self._graph(view, dtype)
        data = {KEY.NODE_FEATURE: self.type_indices(view.numbers), KEY.EDGE_IDX: edge_index, KEY.EDGE_VEC: vectors}
        if self.modal_index is not None:
            data[KEY.MODAL_TYPE] = torch.tensor(self.modal_index, dtype=torch.int64, device=vectors.device)
        return data

    def _embed(self, data: dict) -> dict:
        dtype = self.dtype
        for module in self.embedding:
            # sevenn's one-hot embeddings are always float32; the model may have been cast.
            data = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in module(data).items()}
        return data

    def _layer_function(self, k: int):
        """Layer ``k``: modules before the convolution and the convolution on every row, the rest on owned rows in layer mode."""
        before, convolution, after = self.layers[k]
        layer_mode = self.halo_mode == "layer"

        def layer(data: dict, owned: torch.Tensor) -> dict:
            data = dict(data)  # sevenn's modules write into their input: a recompute (checkpoint) needs it unchanged
            for module in before:
                data = module(data)
            data = convolution(data)
            if layer_mode:
                # Only owned centres received complete messages: finish the layer on them.
                data = _owned(data, owned)
            for module in after:
                data = module(data)
            return data

        return layer

    def _readout(self, data: dict, owned: torch.Tensor) -> torch.Tensor:
        data = _owned(data, owned)
        for module in self.readout:
            data = module(data)
        return data[_keys().ATOMIC_ENERGY].reshape(-1)

    # ------------------------------------------------------------------ forward
    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:
        KEY = _keys()
        run = self.stages.run  # local pieces, compiled with compile=True; refreshes stay eager between them
        owned = torch.arange(view.n_owned, device=view.positions.device)  # by index inside stages: a new count needs no recompile
        data = run("embedding", self._embed, self._inputs(view, self.dtype))
        rows = {k: data[k] for k in _node_keys() if k in data and k != KEY.NODE_FEATURE}
        for k in range(self.num_layers):
            data = run(f"layer{k}", self._layer_function(k), data, owned, recompute=True)
            if self.halo_mode == "layer" and k + 1 < self.num_layers:
                # Ghosts take their owners' features before the next layer.
                data = {**data, **rows, KEY.NODE_FEATURE: view.refresh(data[KEY.NODE_FEATURE])}
        energies = run("readout", self._readout, data, owned)
        return ModelOutput(energies=energies.to(view.positions.dtype))


def _owned(data: dict, owned: torch.Tensor) -> dict:
    """The data with its per-row entries cut to the ``owned`` rows (an index tensor: the first rows)."""
    keys = _node_keys()
    return {k: (v[owned] if k in keys else v) for k, v in data.items()}


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"SevenNet: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def _modal_index(module: torch.nn.Module, modal: str | None) -> int | None:
    """Index of the requested fidelity in a multi-fidelity model (None for single-fidelity ones)."""
    modal_map = getattr(module, "modal_map", None) or {}
    if not modal_map:
        if modal is not None:
            raise ValueError(f"SevenNet: modal={modal!r} was given but the model has a single fidelity; remove modal")
        return None
    by_lower = {name.lower(): i for name, i in modal_map.items()}
    if modal is None or modal.lower() not in by_lower:
        raise ValueError(f"SevenNet: this multi-fidelity model needs modal= one of {sorted(modal_map)}, got {modal!r}")
    return int(by_lower[modal.lower()])
