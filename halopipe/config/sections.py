"""The sections of a run configuration and :class:`RunSpec`, the whole file.

Each section validates its own values; :class:`RunSpec` adds what needs several sections (groups refer to
models, the default run directory follows the name). Relative paths are resolved against
``context['base']``, the configuration file's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, model_validator

from .errors import ConfigError
from .fields import CompileOptions, Count, ElementTable, ExistingFile, Int, NonNegative, Positive, PositiveInt, Section, tagged_union
from .integrators import IntegratorEntry
from .models import ModelEntry

__all__ = ["RunSpec", "SystemSpec", "GroupSpec", "StepSpec", "DomainSpec", "OutputsSpec"]


# ------------------------------------------------------------------- system
class VelocitiesSpec(Section):
    """Maxwell-Boltzmann velocities at the start."""

    temperature: NonNegative = Field(description="K")
    seed: Int = 0


class ArgonSpec(Section):
    """fcc argon, ``4 cells**3`` atoms."""

    type: Literal["argon"]
    cells: PositiveInt = 4
    lattice: Positive = Field(5.26, description="Å")
    rattle: NonNegative = Field(0.0, description="Gaussian displacement, Å")
    seed: Int = 0

    def build(self, dtype):
        import numpy as np
        from ase.build import bulk

        from ..system import System

        atoms = bulk("Ar", "fcc", a=self.lattice, cubic=True).repeat((self.cells,) * 3)
        if self.rattle > 0:
            atoms.positions += np.random.default_rng(self.seed).normal(scale=self.rattle, size=atoms.positions.shape)
        return System.from_ase(atoms, dtype=dtype)


class NaClSpec(Section):
    """The demo's rattled rock-salt NaCl in a slightly triclinic cell, ``8 cells**3`` atoms."""

    type: Literal["nacl"]
    cells: PositiveInt = 3
    rattle: NonNegative = Field(0.25, description="Gaussian displacement, Å")
    seed: Int = 0

    def build(self, dtype):
        from ..demo import demo_system

        return demo_system(cells=self.cells, seed=self.seed, dtype=dtype, rattle=self.rattle)


_Generators = tagged_union((ArgonSpec, NaClSpec), "generator")
Generator = Annotated[
    _Generators,
    BeforeValidator(lambda v: {"type": v} if isinstance(v, str) else v, json_schema_input_type=Literal["argon", "nacl"] | _Generators),
]
"""A generator by name (``argon``) or with options (``{type: argon, cells: 4}``)."""


class SystemSpec(Section):
    """The starting structure: a file ASE reads, or a built-in generator."""

    file: ExistingFile | None = Field(None, description="structure file (any format ASE reads); relative to this configuration")
    format: str | None = Field(None, description="ASE format name, if the file's name does not tell")
    index: Int | None = Field(None, description="frame of a multi-frame file (default: the last)")
    generator: Generator | None = Field(None, description="built-in system: argon or nacl, or {type: ..., cells: ...}")
    velocities: VelocitiesSpec | None = None
    charges: ElementTable | None = Field(None, description="per-element charges, e (the 'charges' field)")
    min_distance: NonNegative = Field(
        0.5, description="closest two atoms may be (images included), Å; nearer contacts stop the run before it starts; 0 disables"
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.file is None) == (self.generator is None):
            raise ConfigError("", "give exactly one of 'file' (a structure ASE can read) or 'generator' (nacl, argon)")
        for key in ("format", "index"):
            if self.generator is not None and getattr(self, key) is not None:
                raise ConfigError(key, "only applies with system.file")
        return self

    def build(self, dtype):
        """The :class:`~halopipe.System` (velocities are drawn later, by the simulation)."""
        import torch

        system = self._read(dtype) if self.file is not None else self.generator.build(dtype)
        system = system.replace(min_distance=self.min_distance)
        if self.charges is None:
            return system
        from .fields import atomic_numbers_of, element_symbol

        charges = atomic_numbers_of(self.charges)
        missing = sorted({int(z) for z in system.numbers.unique()} - set(charges))
        if missing:
            raise ConfigError("charges", f"no charge given for {', '.join(element_symbol(z) for z in missing)} present in the system")
        table = torch.zeros(119, dtype=system.dtype)
        for z, q in charges.items():
            table[z] = q
        return system.replace(fields={**system.fields, "charges": table[system.numbers]})

    def _read(self, dtype):
        import ase.io

        from ..system import System

        try:
            atoms = ase.io.read(self.file, index=-1 if self.index is None else self.index, format=self.format)
        except Exception as exc:  # ASE raises many kinds
            raise ConfigError("file", f"ASE could not read {self.file!r}: {type(exc).__name__}: {exc}") from exc
        return System.from_ase(atoms, dtype=dtype)


# ------------------------------------------------------------------- groups
class StepSpec(Section):
    """One model in a group; a bare model name is ``{model: name}``."""

    model: str
    wire: dict[str, str] = Field(default_factory=dict, description="renames produced fields: {produced: visible}")
    bind: dict[str, str] = Field(default_factory=dict, description="where inputs come from: {input: visible}")
    name: str | None = Field(None, description="label of this step's energy (default: the model's name)")


Step = Annotated[StepSpec, BeforeValidator(lambda v: {"model": v} if isinstance(v, str) else v, json_schema_input_type=str | StepSpec)]
"""A step by model name (``lj``) or in full (``{model: pme, bind: {charges: q}}``)."""


class GroupSpec(Section):
    """Models evaluated together: with direct forces (``autograd: false``) or differentiated once."""

    steps: list[Step] = Field(min_length=1)
    autograd: bool | None = Field(None, description="default: direct when every model offers direct forces and none produces a field")


# ------------------------------------------------------------------- domain
class DomainSpec(Section):
    """How space is split among ranks. Unset keys take :class:`~halopipe.DomainConfig`'s defaults,
    the one owner of them (so the skin has a single default)."""

    grid: list[PositiveInt] | None = Field(None, min_length=3, max_length=3, description="bricks per axis [px, py, pz]; null: chosen")
    skin: NonNegative | None = Field(None, description="neighbour-list skin, Å")
    halo: Literal["per_model", "max"] | None = None
    timeout: Positive | None = Field(None, description="seconds a rank waits for its peers")

    @model_validator(mode="after")
    def _defaults(self):
        from ..domain import DomainConfig

        default = DomainConfig()
        for name in ("skin", "halo", "timeout"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(default, name))
        return self

    def build(self):
        """The :class:`~halopipe.DomainConfig`."""
        from ..domain import DomainConfig

        grid = tuple(self.grid) if self.grid is not None else None
        return DomainConfig(grid=grid, skin=self.skin, halo=self.halo, timeout=self.timeout)


# ------------------------------------------------------------------ outputs
class OutputsSpec(Section):
    """What rank 0 writes, and how often (0 = never)."""

    directory: str | None = Field(None, description="run directory (default runs/<name>), relative to the working directory")
    thermo_every: Count = 10
    trajectory_every: Count = 100
    checkpoint_every: Count = 1000
    progress: bool = True
    plot: bool = True
    pressure: bool = True

    @model_validator(mode="after")
    def _plot_needs_thermo(self):
        if self.plot and not self.thermo_every:
            raise ConfigError("plot", "the plot is made from the thermo log; set outputs.thermo_every > 0 or plot: false")
        return self


# ---------------------------------------------------------------------- run
class RunSpec(Section):
    """A halopipe run configuration (``halopipe run config.yaml``)."""

    name: str | None = Field(None, description="run name and default directory runs/<name> (default: the file's stem)")
    system: SystemSpec
    models: dict[str, ModelEntry] = Field(min_length=1, description="name -> {type: ..., parameters}")
    groups: list[GroupSpec] | None = Field(None, min_length=1, description="default: one group per model")
    domain: DomainSpec = Field(default_factory=DomainSpec)
    integrator: IntegratorEntry
    steps: Count
    nproc: PositiveInt = Field(1, description="local processes (ranks)")
    outputs: OutputsSpec = Field(default_factory=OutputsSpec)
    precision: Literal["float64", "float32"] = Field(
        "float64", description="dtype of positions, integration and physics models; an MLIP keeps its weights' dtype (SevenNet: dtype)"
    )
    device: Literal["cpu", "cuda"] = "cpu"
    compile: bool = Field(False, description="compile every MLIP's local stages with torch.compile (MACE, SevenNet, TorchModel)")
    compile_kwargs: CompileOptions | None = Field(None, description="torch.compile options: dynamic, fullgraph, mode, options")

    @model_validator(mode="after")
    def _complete(self, info: ValidationInfo):
        source = (info.context or {}).get("source", "<config>")
        if self.name is None:
            self.name = Path(source).stem if source != "<config>" else "run"
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError("name", f"must be a plain directory name, got {self.name!r}")
        directory = Path(self.outputs.directory or f"runs/{self.name}").expanduser()
        self.outputs.directory = str(directory if directory.is_absolute() else Path.cwd() / directory)
        self._check_groups()
        if self.compile_kwargs is not None and not self.compile:
            raise ConfigError("compile_kwargs", "given without 'compile: true'; add it or remove compile_kwargs")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("device", "'cuda' requested but torch sees no CUDA device")
        return self

    def _check_groups(self) -> None:
        """Every group step names a model; each model is used exactly once."""
        if self.groups is None:
            return
        used: dict[str, str] = {}
        for g, group in enumerate(self.groups):
            for s, step in enumerate(group.steps):
                where = f"groups[{g}].steps[{s}]"
                if step.model not in self.models:
                    raise ConfigError(f"{where}.model", f"{step.model!r} is not a model defined under 'models' ({', '.join(self.models)})")
                if step.model in used:
                    raise ConfigError(f"{where}.model", f"model {step.model!r} is already used at {used[step.model]}; define another")
                used[step.model] = where
        unused = [name for name in self.models if name not in used]
        if unused:
            raise ConfigError(f"models.{unused[0]}", "is not used by any group; add it to 'groups' or remove it")
