"""Loading a run configuration and building its pieces (system, models, pipeline, integrator, domain)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import ValidationError

from ..pipeline import Group, Pipeline, Step
from .errors import ConfigError, config_error, join_key
from .sections import RunSpec

__all__ = ["RunConfig", "parse_config", "load_config", "config_schema"]


def _validate(data, base: str | Path, source: str) -> RunSpec:
    try:
        return RunSpec.model_validate(data, context={"base": str(base), "source": source})
    except ValidationError as exc:
        raise config_error(exc, data) from None


class RunConfig:
    """A validated configuration and the builders of its pieces.

    Parameters
    ----------
    data : the configuration mapping (validated here), or a :class:`RunSpec`.
    source : the file it came from (for the default name and messages).
    base : directory that relative paths in ``data`` are relative to.

    ``data`` (the attribute) is the plain, picklable mapping, complete with defaults and resolved paths:
    ``RunConfig(config.data)`` is the same configuration, which is how spawned ranks receive it.
    """

    def __init__(self, data: Mapping | RunSpec, source: str = "<config>", base: str | Path = ".") -> None:
        self.spec = data if isinstance(data, RunSpec) else _validate(data, base, source)
        self.source = source
        self.data: dict = self.spec.model_dump(mode="json", exclude_none=True)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def steps(self) -> int:
        return self.spec.steps

    @property
    def nproc(self) -> int:
        return self.spec.nproc

    @property
    def outputs(self) -> dict:
        return self.spec.outputs.model_dump()

    @property
    def dtype(self) -> torch.dtype:
        return {"float64": torch.float64, "float32": torch.float32}[self.spec.precision]

    @property
    def device(self) -> torch.device:
        if self.spec.device == "cuda" and torch.distributed.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.spec.device)

    def with_steps(self, steps: int) -> RunConfig:
        return RunConfig({**self.data, "steps": steps}, self.source)

    # ----------------------------------------------------------------- builders
    def build_system(self):
        """The initial :class:`~halopipe.System` (velocities not yet drawn; see ``system.velocities``)."""
        try:
            return self.spec.system.build(self.dtype).to(device=self.device)
        except ConfigError as exc:
            raise ConfigError(join_key("system", exc.key), exc.message) from exc

    def build_models(self) -> dict:
        """Each configured model by name, constructed now."""
        return {name: _build_model(spec, f"models.{name}") for name, spec in self.spec.models.items()}

    def build_pipeline(self, models: dict | None = None):
        """The composite :class:`~halopipe.Pipeline` of the configured (or the given, already built) models."""
        models = self.build_models() if models is None else models
        try:
            if self.spec.groups is None:
                groups = [Step(model, name=name) for name, model in models.items()]
            else:
                groups = [_group(spec, models) for spec in self.spec.groups]
            pipeline = Pipeline(groups, config=self.domain_config(), compile=self.spec.compile, compile_kwargs=self.spec.compile_kwargs)
        except (ValueError, TypeError) as exc:
            raise ConfigError("groups", str(exc)) from exc
        for model in pipeline.models:  # an MLIP keeps its trained precision (own_dtype): geometry is cast to it, not it
            if not model.own_dtype:
                model.to(dtype=self.dtype)
        return pipeline.to(device=self.device)

    def build_integrator(self):
        try:
            return self.spec.integrator.build()
        except ValueError as exc:
            raise ConfigError("integrator", str(exc)) from exc

    def domain_config(self):
        """The :class:`~halopipe.DomainConfig` of the ``domain`` section (the pipeline holds it)."""
        return self.spec.domain.build()

    # ------------------------------------------------------------------- checks
    def check_fields(self, system, pipeline=None) -> None:
        """The system must carry every field the models consume and no step produces."""
        pipeline = self.build_pipeline() if pipeline is None else pipeline
        missing = sorted(pipeline.required_fields() - set(system.fields))
        if missing:
            raise ConfigError(
                "system",
                f"the models need per-atom field(s) {missing} that no step produces; give system.charges, "
                "a structure file with them, or wire a model that produces them",
            )

    def check_species(self, system, models: dict) -> None:
        """Every model has parameters for every species of the system; the message names the elements."""
        species = sorted({int(z) for z in system.numbers.unique()})
        for name, spec in self.spec.models.items():
            problem = spec.missing_species(models[name], species)
            if problem:
                raise ConfigError(f"models.{name}", problem)


def _build_model(spec, key: str):
    try:
        return spec.build()
    except ConfigError as exc:
        raise ConfigError(join_key(key, exc.key), exc.message) from exc
    except (ValueError, TypeError) as exc:
        raise ConfigError(key, f"{type(spec).__name__.removesuffix('Spec')} rejected its parameters: {exc}") from exc


def _group(spec, models: dict) -> Group:
    steps = [Step(models[s.model], wire=s.wire, bind=s.bind, name=s.name or s.model) for s in spec.steps]
    autograd = spec.autograd
    if autograd is None:
        autograd = not all(s.model.direct_forces and not s.model.outputs for s in steps)
    return Group(steps, autograd=autograd)


def parse_config(data, base: str | Path = ".", source: str = "<config>", check_system: bool = True) -> RunConfig:
    """Validate a configuration mapping (as loaded from YAML) and fill in defaults.

    Every model and the integrator are constructed once, so that bad parameter values fail here, naming
    the model.

    Parameters
    ----------
    data : the mapping.
    base : directory relative paths are resolved against.
    source : name used for the default run name and in messages.
    check_system : also build the system and check that the models cover its species and get the
        fields they need (reads the structure file).
    """
    config = RunConfig(data, source, base)
    models = config.build_models()
    pipeline = config.build_pipeline(models)
    config.build_integrator()
    if check_system:
        system = config.build_system()
        config.check_species(system, models)
        config.check_fields(system, pipeline)
    return config


def _structure_format(path: Path) -> str | None:
    """The ASE format that ``path``'s name suggests, if any."""
    from ase.io.formats import UnknownFileTypeError, filetype

    if path.suffix.lower() in (".yaml", ".yml"):
        return None
    try:
        return filetype(str(path), read=False)
    except (UnknownFileTypeError, ValueError):
        return None


def _not_a_configuration(path: Path, why: str) -> ConfigError:
    kind = _structure_format(path)
    hint = (
        f"; it looks like a structure file ({kind}): name it in a YAML configuration as system: {{file: {path.name}}}"
        if kind
        else "; a configuration is a YAML mapping with system, models, integrator and steps"
    )
    return ConfigError("<file>", f"{path} {why}{hint}")


def load_config(path: str | Path, check_system: bool = True) -> RunConfig:
    """Read and validate a YAML configuration file (see :mod:`halopipe.config`)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError("<file>", f"configuration file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except UnicodeDecodeError:
        raise _not_a_configuration(path, "is not a text file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1}: {exc.problem})" if mark is not None else ""
        raise _not_a_configuration(path, f"is not valid YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _not_a_configuration(path, f"is not a halopipe configuration (its YAML is a {type(data).__name__}, not a mapping)")
    if data and not data.keys() & RunSpec.model_fields.keys():
        raise _not_a_configuration(path, "is not a halopipe configuration (it has none of the sections)")
    return parse_config(data, base=path.parent, source=str(path), check_system=check_system)


def config_schema() -> dict:
    """The JSON schema of a run configuration (for editors: ``halopipe schema > halopipe.schema.json``)."""
    schema = RunSpec.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "halopipe run configuration"}
