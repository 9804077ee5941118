"""Model types of the ``models:`` section: one pydantic spec per model class.

A spec's fields are the model's constructor parameters (an unset one takes the model's own default), and
``type`` chooses the spec. A spec also says how to build its model (:meth:`ModelSpec.build`) and which
species of a system its model cannot handle (:meth:`ModelSpec.missing_species`), so that a missing
parameter is found when the configuration loads. Adding a model type is one class here plus its entry in
:data:`MODEL_SPECS`, for example::

    class SevenNetSpec(ModelSpec):
        target: ClassVar[str] = "halopipe.models.sevennet:SevenNet"
        type: Literal["SevenNet"]
        model: str = Field(description="checkpoint name or file")

A ``type`` of the form ``package.module:Class`` names any :class:`~halopipe.models.Model` subclass; its
parameters are checked against the class's signature.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, ValidationInfo, model_validator

from .errors import ConfigError
from .fields import (
    CompileOptions,
    ElementTable,
    ExistingFile,
    ImportPath,
    Int,
    NonNegative,
    Number,
    PerElement,
    PerPair,
    Positive,
    PositiveInt,
    Section,
    _existing_file,
    atomic_numbers_of,
    element_symbol,
    import_object,
    tagged_union,
    type_names,
)

__all__ = ["MODEL_SPECS", "MODEL_TYPES", "ModelEntry", "ModelSpec", "resolve_model_type"]


class ModelSpec(Section):
    """Base of the model types (see the module docstring)."""

    target: ClassVar[str]
    """``'package.module:Class'`` of the model, imported when the model is built."""

    def parameters(self) -> dict[str, Any]:
        """The constructor's keyword arguments: the fields set, with species keys as atomic numbers."""
        return {k: atomic_numbers_of(v) for k, v in self.model_dump(exclude={"type"}, exclude_none=True).items()}

    def model_class(self) -> type:
        return import_object(self.target, "model class")

    def build(self):
        """The model (a :class:`~halopipe.models.Model`)."""
        return self.model_class()(**self.parameters())

    def missing_species(self, model, species: list[int]) -> str | None:
        """What ``model`` lacks for the atomic numbers ``species`` of a system, as a message; None if nothing."""
        return None


def _symbols(zs) -> str:
    return ", ".join(element_symbol(int(z)) for z in zs)


class LennardJonesSpec(ModelSpec):
    """12-6 Lennard-Jones with Lorentz-Berthelot mixing."""

    target: ClassVar[str] = "halopipe.models.lennard_jones:LennardJones"
    type: Literal["LennardJones"]
    epsilon: PerPair | None = Field(None, description="well depth, eV: one number, or per element / 'A-B' pair")
    sigma: PerPair | None = Field(None, description="zero-crossing distance, Å: one number, or per element / 'A-B' pair")
    cutoff: Positive | None = Field(None, description="Å")
    shift: bool | None = Field(None, description="shift pair energies to zero at the cutoff")

    def missing_species(self, model, species):
        known = model.known[species][:, species]
        lacking = [z for k, z in enumerate(species) if not bool(known[k, k])]
        if lacking:
            return f"no epsilon/sigma for {_symbols(lacking)} present in the system; add them per element or per 'A-B' pair"
        pairs = [f"{element_symbol(species[i])}-{element_symbol(species[j])}" for i, j in (~known).nonzero().tolist() if i < j]
        return (
            f"no epsilon/sigma for the pair(s) {', '.join(pairs)} present in the system; add them per element or per pair"
            if pairs
            else None
        )


class DSFCoulombSpec(ModelSpec):
    """Damped shifted-force Coulomb (consumes the ``charges`` field)."""

    target: ClassVar[str] = "halopipe.models.coulomb:DSFCoulomb"
    type: Literal["DSFCoulomb"]
    cutoff: Positive | None = Field(None, description="Å")
    alpha: NonNegative | None = Field(None, description="damping, 1/Å")


class ChargeModelSpec(ModelSpec):
    """Charges from species and coordination with an exact total charge (produces ``charges``)."""

    target: ClassVar[str] = "halopipe.models.charges:ChargeModel"
    type: Literal["ChargeModel"]
    cutoff: Positive | None = Field(None, description="coordination cutoff, Å")
    electronegativity: ElementTable | None = Field(None, description="per-element raw charge offsets, e (default from Pauling's)")
    coordination_weight: PerElement | None = Field(None, description="e per neighbour: one number or per element")
    total_charge: Number | None = Field(None, description="e")
    hardness: PerElement | None = Field(None, description="self-energy J, eV/e²: one number or per element")

    def missing_species(self, model, species):
        lacking = [z for z in species if not bool(model.known[z])]
        return f"no electronegativity for {_symbols(lacking)} present in the system; add it to electronegativity" if lacking else None


class EwaldSpec(ModelSpec):
    """Ewald summation (consumes ``charges``; periodic cells)."""

    target: ClassVar[str] = "halopipe.models.ewald:Ewald"
    type: Literal["Ewald"]
    cutoff: Positive | None = Field(None, description="real-space cutoff, Å")
    accuracy: Positive | None = Field(None, description="target relative accuracy (sets alpha and kmax)")
    alpha: Positive | None = Field(None, description="splitting parameter override, 1/Å")
    kmax: Positive | None = Field(None, description="reciprocal cutoff override, 1/Å")


class PMESpec(ModelSpec):
    """Smooth particle-mesh Ewald (consumes ``charges``; periodic cells)."""

    target: ClassVar[str] = "halopipe.models.pme:PME"
    type: Literal["PME"]
    cutoff: Positive | None = Field(None, description="real-space cutoff, Å")
    accuracy: Positive | None = Field(None, description="target relative accuracy (sets alpha and the mesh)")
    mesh_spacing: Positive | None = Field(None, description="largest mesh spacing, Å")
    mesh_size: list[PositiveInt] | None = Field(None, min_length=3, max_length=3, description="explicit mesh [n1, n2, n3]")
    order: Int | None = Field(None, description="B-spline order, 3 to 5")
    alpha: Positive | None = Field(None, description="splitting parameter override, 1/Å")
    mesh: Literal["auto", "replicated", "distributed", "slab", "pencil"] | None = Field(
        None,
        description="mesh shared by the ranks: replicated, distributed (slabs or pencils, chosen by the grid), "
        "slab or pencil (distributed, forced), or chosen by size (auto, default)",
    )


class DFTD3Spec(ModelSpec):
    """DFT-D3 dispersion with Becke-Johnson or zero damping."""

    target: ClassVar[str] = "halopipe.models.dftd3:DFTD3"
    type: Literal["DFTD3"]
    functional: str | None = Field(None, description="functional whose D3 parameters to use, e.g. pbe")
    damping: Literal["bj", "zero"] | None = None
    cutoff: Positive | None = Field(None, description="two-body cutoff, Å")
    cn_cutoff: Positive | None = Field(None, description="coordination-number cutoff, Å")
    s9: Number | None = Field(None, description="three-body (ATM) scaling; 0 = off")
    atm_cutoff: Positive | None = Field(None, description="three-body cutoff, Å")
    params: dict[str, Number] | None = Field(None, description="damping parameters overriding the functional's")

    def missing_species(self, model, species):
        from ..models.dftd3 import MAX_Z

        lacking = [z for z in species if z > MAX_Z]
        return f"no D3 reference data for {_symbols(lacking)} present in the system (the tables end at Lr)" if lacking else None


class DFTD3MeshSpec(ModelSpec):
    """DFT-D3(BJ) with the two-body sum on a particle mesh (no dispersion cutoff; periodic cells)."""

    target: ClassVar[str] = "halopipe.models.dftd3_mesh:DFTD3Mesh"
    type: Literal["DFTD3Mesh"]
    functional: str | None = Field(None, description="functional whose D3(BJ) parameters to use, e.g. pbe")
    damping: Literal["bj"] | None = None
    accuracy: Positive | None = Field(None, description="target relative two-body energy error (sets the mesh)")
    rank_tolerance: Positive | None = Field(None, description="relative error bound of the low-rank C6 (default: accuracy)")
    mesh_spacing: Positive | None = Field(None, description="largest mesh spacing, Å")
    mesh_size: list[PositiveInt] | None = Field(None, min_length=3, max_length=3, description="explicit mesh [n1, n2, n3]")
    order: Int | None = Field(None, description="B-spline order, 4 to 6")
    cn_cutoff: Positive | None = Field(None, description="coordination-number cutoff, Å")
    s9: Number | None = Field(None, description="three-body (ATM) scaling, real space with atm_cutoff; 0 = off")
    atm_cutoff: Positive | None = Field(None, description="three-body cutoff, Å")
    params: dict[str, Number] | None = Field(None, description="damping parameters overriding the functional's")
    mesh: Literal["auto", "slab", "pencil"] | None = Field(None, description="how ranks share the mesh")

    def missing_species(self, model, species):
        return DFTD3Spec.missing_species(self, model, species)


def _load_module(path: str):
    """A torch module saved whole with ``torch.save`` (unpickled: load only files you trust), on the CPU."""
    import torch

    try:
        module = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load raises many kinds for a file that is not a saved module
        raise ConfigError("file", f"could not load {path!r} with torch.load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(module, torch.nn.Module):
        raise ConfigError("file", f"{path!r} holds a {type(module).__name__}, not a torch module; save the module with torch.save")
    return module


class MACESpec(ModelSpec):
    """A mace-torch model file (needs the ``[mace]`` extra)."""

    target: ClassVar[str] = "halopipe.models.mace:MACE"
    type: Literal["MACE"]
    file: ExistingFile = Field(description="model saved by mace-torch (torch.save); relative to this configuration")
    halo_mode: Literal["layer", "wide"] | None = Field(None, description="layer: halo r_max with refreshed ghosts (default)")
    head: str | None = Field(None, description="readout head of a multi-head model")
    compile: bool | None = Field(None, description="run the network's local stages through torch.compile")
    compile_kwargs: CompileOptions | None = Field(None, description="torch.compile options: dynamic, fullgraph, mode, options")
    checkpoint: bool | None = Field(None, description="recompute each layer's activations in the backward pass (less memory)")

    def build(self):
        parameters = self.parameters()
        return self.model_class()(_load_module(parameters.pop("file")), **parameters)

    def missing_species(self, model, species):
        lacking = [z for z in species if z not in model.species]
        if lacking:
            return f"the MACE model has no {_symbols(lacking)} (it knows {_symbols(model.species)}); use a model trained on them"
        return None


def _sevennet_model(value: str, info: ValidationInfo) -> str:
    """A pretrained name stays as it is; a path (it has a '/' or ends in '.pth') must exist, relative to this configuration."""
    if "/" in value or value.endswith(".pth"):
        return _existing_file(value, info)
    return value


class SevenNetSpec(ModelSpec):
    """A pretrained SevenNet potential (needs the ``[sevenn]`` extra, in its own environment: see noxfile.py)."""

    target: ClassVar[str] = "halopipe.models.sevennet:SevenNet"
    type: Literal["SevenNet"]
    model: Annotated[str, AfterValidator(_sevennet_model)] = Field(
        "7net-0", description="a name shipped with sevenn (7net-0, 7net-l3i5, 7net-mf-0, ...) or a .pth checkpoint file"
    )
    modal: str | None = Field(None, description="fidelity of a multi-fidelity model (e.g. 'mpa' for 7net-mf-0)")
    halo_mode: Literal["layer", "wide"] | None = Field(None, description="layer: halo of one cutoff with refreshed ghosts (default)")
    compile: bool | None = Field(None, description="run the network's local stages through torch.compile")
    compile_kwargs: CompileOptions | None = Field(None, description="torch.compile options: dynamic, fullgraph, mode, options")
    checkpoint: bool | None = Field(None, description="recompute each layer's activations in the backward pass (less memory)")

    def missing_species(self, model, species):
        lacking = [z for z in species if z not in model.species]
        if lacking:
            return f"the SevenNet model has no {_symbols(lacking)}; use a model trained on them"
        return None


class TorchModelSpec(ModelSpec):
    """A plain torch module mapping a graph to per-atom energies (see :class:`~halopipe.models.TorchModel`)."""

    target: ClassVar[str] = "halopipe.models.adapter:TorchModel"
    type: Literal["TorchModel"]
    file: ExistingFile | None = Field(None, description="module saved whole with torch.save (trusted files only)")
    factory: ImportPath | None = Field(None, description="'package.module:callable' returning the module")
    options: dict[str, Any] | None = Field(None, description="keyword arguments of the factory")
    cutoff: Positive = Field(description="graph radius, Å")
    layers: PositiveInt | None = Field(None, description="message-passing layers (the receptive field is layers * cutoff)")
    per_layer: bool | None = Field(None, description="halo of one cutoff with ghost features refreshed between layers")
    compile: bool | None = Field(None, description="run the network's local stages through torch.compile")
    compile_kwargs: CompileOptions | None = Field(None, description="torch.compile options: dynamic, fullgraph, mode, options")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.file is None) == (self.factory is None):
            raise ConfigError("", "give exactly one of 'file' (a saved module) or 'factory' ('package.module:callable')")
        if self.options is not None and self.factory is None:
            raise ConfigError("options", "only applies with factory")
        return self

    def build(self):
        parameters = self.parameters()
        file, factory, options = parameters.pop("file", None), parameters.pop("factory", None), parameters.pop("options", {})
        module = _load_module(file) if file is not None else _call_factory(factory, options)
        return self.model_class()(module, **parameters)


def _call_factory(target: str, options: dict):
    try:
        factory = import_object(target, "factory")
    except ConfigError as exc:
        raise ConfigError("factory", exc.message) from exc
    try:
        return factory(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError("options", f"{target} rejected them: {exc}") from exc


class ClassPathSpec(ModelSpec):
    """Any Model subclass named ``package.module:Class``; the other keys are its parameters."""

    model_config = ConfigDict(extra="allow")
    type: ImportPath

    @model_validator(mode="after")
    def _check_class(self):
        signature = inspect.signature(resolve_model_type(self.type, "type").__init__)
        accepted = [n for n, p in list(signature.parameters.items())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
            for name in self.model_extra:
                if name not in accepted:
                    raise ConfigError(name, f"unknown parameter of {self.type}; accepted: {', '.join(accepted)}")
        return self

    def parameters(self):
        return {k: atomic_numbers_of(v) for k, v in self.model_extra.items()}

    def model_class(self):
        return resolve_model_type(self.type, "type")


MODEL_SPECS: dict[str, type[ModelSpec]] = {
    type_names(spec)[0]: spec
    for spec in (
        LennardJonesSpec,
        DSFCoulombSpec,
        ChargeModelSpec,
        EwaldSpec,
        PMESpec,
        DFTD3Spec,
        DFTD3MeshSpec,
        MACESpec,
        SevenNetSpec,
        TorchModelSpec,
    )
}
"""The built-in model types by ``type`` name."""

MODEL_TYPES: dict[str, str] = {name: spec.target for name, spec in MODEL_SPECS.items()}
"""Built-in model type names and where their classes live (imported on first use)."""

ModelEntry = tagged_union(MODEL_SPECS.values(), "model type", fallback=ClassPathSpec, hint=" (or 'package.module:Class')")
"""One entry of ``models:``."""


def resolve_model_type(name: str, key: str):
    """The model class for a type name (built-in name or ``package.module:Class``), imported now."""
    from ..models.base import Model

    target = MODEL_TYPES.get(name, name)
    if ":" not in target and "." not in target:
        raise ConfigError(key, f"unknown model type {name!r}; built-in types: {', '.join(MODEL_TYPES)} (or 'package.module:Class')")
    try:
        cls = import_object(target, "model type")
    except ConfigError as exc:
        raise ConfigError(key, exc.message) from exc
    if not (inspect.isclass(cls) and issubclass(cls, Model)):
        raise ConfigError(key, f"{target} is not a halopipe Model class")
    return cls
