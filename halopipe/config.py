"""Run configuration files (YAML): what to simulate, with which models, how, and where to write.

A configuration is a YAML mapping with these sections (only ``system``,
``models``, ``integrator`` and ``steps`` are required)::

    name: argon                       # run directory name (default: the file's stem)
    system:
      generator: {type: argon, cells: 4}       # or: file: structure.xyz (any format ASE reads)
      velocities: {temperature: 300, seed: 1}  # Maxwell-Boltzmann start (else from the file, or zero)
    models:                           # name -> model type and its constructor parameters
      lj: {type: LennardJones, epsilon: 0.0104, sigma: 3.4, cutoff: 8.5}
    groups:                           # optional; default: one group per model
      - {steps: [lj], autograd: false}
    domain: {grid: null, skin: 1.0}
    integrator: {type: langevin, timestep: 2.0, temperature: 300, friction: 0.01, seed: 0}
    steps: 10000
    nproc: 1
    outputs: {directory: runs/argon, thermo_every: 10, trajectory_every: 100, checkpoint_every: 1000}

Every value is checked when the file is loaded; an unknown key, a missing file
or a bad value raises :class:`ConfigError` naming the key (``integrator.timestep``,
``models.lj.cutoff``...). Model types are resolved lazily by name, so a model
module is imported only when a configuration uses it. Per-species parameters
may be keyed by element symbol (``{Na: 0.01}``) or pair (``{Na-Cl: 3.0}``).
Relative paths are relative to the configuration file.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_config", "MODEL_TYPES", "INTEGRATOR_TYPES", "GENERATORS"]

MODEL_TYPES = {
    "LennardJones": "halopipe.models.lennard_jones:LennardJones",
    "DSFCoulomb": "halopipe.models.coulomb:DSFCoulomb",
    "ChargeModel": "halopipe.models.charges:ChargeModel",
    "Ewald": "halopipe.models.ewald:Ewald",
    "PME": "halopipe.models.pme:PME",
    "DFTD3": "halopipe.models.dftd3:DFTD3",
}
"""Built-in model type names and where they live (imported on first use)."""

INTEGRATOR_TYPES = {
    "velocity_verlet": "VelocityVerlet",
    "nve": "VelocityVerlet",
    "langevin": "Langevin",
    "nose_hoover_chain": "NoseHooverChain",
    "nhc": "NoseHooverChain",
    "fire": "FIRE",
}
"""Integrator names accepted in ``integrator.type``."""

GENERATORS = {"nacl": {"cells": 3, "seed": 0, "rattle": 0.25}, "argon": {"cells": 4, "lattice": 5.26, "rattle": 0.0, "seed": 0}}
"""Built-in system generators and their default options."""

_TOP = {"name", "system", "models", "groups", "domain", "integrator", "steps", "nproc", "outputs", "precision", "device"}
_OUTPUTS = {
    "directory": None,
    "thermo_every": 10,
    "trajectory_every": 100,
    "checkpoint_every": 1000,
    "progress": True,
    "plot": True,
    "pressure": True,
}
_DOMAIN = {"grid": None, "skin": 1.0, "halo": "per_model", "timeout": 120.0}


class ConfigError(ValueError):
    """A configuration problem; the message starts with the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key = key


# ------------------------------------------------------------------ checks
def _mapping(value, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a mapping, got {type(value).__name__} {value!r}")
    return value


def _known_keys(section: dict, allowed, key: str) -> None:
    for k in section:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise ConfigError(where, f"unknown key; allowed here: {', '.join(sorted(map(str, allowed)))}")


def _number(value, key: str, *, minimum: float | None = None, positive: bool = False, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ConfigError(key, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(key, f"must be finite, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(key, f"must be positive, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value!r}")
    return value


def _boolean(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}")
    return value


def _string(value, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a non-empty string, got {value!r}")
    return value


def _element_key(key, where: str):
    """``'Na'`` -> 11, ``'Na-Cl'`` -> (11, 17), ints unchanged; other strings are left alone."""
    from ase.data import atomic_numbers

    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str):
        parts = key.split("-")
        if all(p in atomic_numbers or p.isdigit() for p in parts) and len(parts) in (1, 2):
            zs = tuple(atomic_numbers[p] if p in atomic_numbers else int(p) for p in parts)
            return zs[0] if len(zs) == 1 else zs
        if len(parts) == 2 or (key[:1].isupper() and len(key) <= 3):
            raise ConfigError(where, f"{key!r} is not an element symbol or an 'A-B' pair of element symbols")
    return key


def _convert_params(params: dict, key: str) -> dict:
    """Element-keyed mappings -> atomic-number keys; lists -> tuples."""
    out = {}
    for name, value in params.items():
        if isinstance(value, dict):
            value = {_element_key(k, f"{key}.{name}.{k}"): v for k, v in value.items()}
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return out


def resolve_model_type(name: str, key: str):
    """The model class for a type name (built-in name or ``module.path:Class``), imported now."""
    from .models.base import Model

    target = MODEL_TYPES.get(name)
    if target is None and (":" in name or "." in name):
        target = name if ":" in name else ":".join(name.rsplit(".", 1))
    if target is None:
        raise ConfigError(key, f"unknown model type {name!r}; built-in types: {', '.join(sorted(MODEL_TYPES))} (or 'package.module:Class')")
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(key, f"model type {name!r} could not be imported ({target}): {exc}") from exc
    if not (inspect.isclass(cls) and issubclass(cls, Model)):
        raise ConfigError(key, f"{target} is not a halopipe Model class")
    return cls


def _check_parameters(cls, params: dict, key: str, skip: int = 1) -> None:
    """Reject parameters the constructor does not accept, naming them."""
    signature = inspect.signature(cls.__init__)
    accepted = [
        p
        for p in list(signature.parameters)[skip:]
        if signature.parameters[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    for name in params:
        if name not in accepted and not takes_any:
            raise ConfigError(f"{key}.{name}", f"unknown parameter of {cls.__name__}; accepted: {', '.join(accepted)}")


def _construct(cls, params: dict, key: str):
    try:
        return cls(**params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(key, f"{cls.__name__} rejected its parameters: {exc}") from exc


# ----------------------------------------------------------------- sections
def _parse_system(value, base: Path) -> dict:
    key = "system"
    section = dict(_mapping(value, key))
    _known_keys(section, {"file", "format", "index", "generator", "velocities", "charges"}, key)
    if ("file" in section) == ("generator" in section):
        raise ConfigError(key, "give exactly one of 'file' (a structure ASE can read) or 'generator' (nacl, argon)")
    out: dict = {}
    if "file" in section:
        path = Path(_string(section["file"], "system.file")).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise ConfigError("system.file", f"file {str(path)!r} does not exist")
        out["file"] = str(path)
        out["format"] = _string(section["format"], "system.format") if "format" in section else None
        out["index"] = _number(section.get("index", -1), "system.index", integer=True)
    else:
        if "format" in section or "index" in section:
            raise ConfigError("system.format" if "format" in section else "system.index", "only applies with system.file")
        gen = section["generator"]
        gen = {"type": gen} if isinstance(gen, str) else dict(_mapping(gen, "system.generator"))
        kind = gen.get("type")
        if kind not in GENERATORS:
            raise ConfigError("system.generator.type", f"unknown generator {kind!r}; built-in: {', '.join(GENERATORS)}")
        defaults = GENERATORS[kind]
        _known_keys(gen, {"type", *defaults}, "system.generator")
        options = {**defaults, **{k: v for k, v in gen.items() if k != "type"}}
        k = "system.generator"
        options["cells"] = _number(options["cells"], f"{k}.cells", integer=True, minimum=1)
        options["seed"] = _number(options["seed"], f"{k}.seed", integer=True)
        options["rattle"] = _number(options["rattle"], f"{k}.rattle", minimum=0.0)
        if "lattice" in options:
            options["lattice"] = _number(options["lattice"], f"{k}.lattice", positive=True)
        out["generator"] = {"type": kind, **options}
    if "velocities" in section:
        vel = dict(_mapping(section["velocities"], "system.velocities"))
        _known_keys(vel, {"temperature", "seed"}, "system.velocities")
        if "temperature" not in vel:
            raise ConfigError("system.velocities.temperature", "missing (K)")
        out["velocities"] = {
            "temperature": _number(vel["temperature"], "system.velocities.temperature", minimum=0.0),
            "seed": _number(vel.get("seed", 0), "system.velocities.seed", integer=True),
        }
    if "charges" in section:
        charges = _mapping(section["charges"], "system.charges")
        out["charges"] = {}
        for sym, q in charges.items():
            z = _element_key(sym, f"system.charges.{sym}")
            if not isinstance(z, int):
                raise ConfigError(f"system.charges.{sym}", "keys must be element symbols")
            out["charges"][z] = _number(q, f"system.charges.{sym}")
    return out


def _parse_models(value) -> dict:
    models = _mapping(value, "models")
    if not models:
        raise ConfigError("models", "define at least one model")
    out = {}
    for name, spec in models.items():
        key = f"models.{name}"
        spec = dict(_mapping(spec, key))
        if "type" not in spec:
            raise ConfigError(f"{key}.type", f"missing; built-in types: {', '.join(sorted(MODEL_TYPES))}")
        cls = resolve_model_type(_string(spec["type"], f"{key}.type"), f"{key}.type")
        params = {k: v for k, v in spec.items() if k != "type"}
        _check_parameters(cls, params, key)
        out[str(name)] = {"type": spec["type"], "params": _convert_params(params, key)}
    return out


def _parse_groups(value, models: dict) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError("groups", "must be a non-empty list of groups ({steps: [...], autograd: ...})")
    used: dict[str, str] = {}
    groups = []
    for g, group in enumerate(value):
        key = f"groups[{g}]"
        group = dict(_mapping(group, key))
        _known_keys(group, {"steps", "autograd"}, key)
        steps = group.get("steps")
        if not isinstance(steps, list) or not steps:
            raise ConfigError(f"{key}.steps", "must be a non-empty list of model names or {model, wire, bind, name} mappings")
        parsed = []
        for s, step in enumerate(steps):
            skey = f"{key}.steps[{s}]"
            step = {"model": step} if isinstance(step, str) else dict(_mapping(step, skey))
            _known_keys(step, {"model", "wire", "bind", "name"}, skey)
            model = step.get("model")
            if model not in models:
                raise ConfigError(f"{skey}.model", f"{model!r} is not a model defined under 'models' ({', '.join(models)})")
            if model in used:
                raise ConfigError(f"{skey}.model", f"model {model!r} is already used at {used[model]}; define a second model instead")
            used[model] = skey
            for k in ("wire", "bind"):
                mapping = _mapping(step.get(k, {}), f"{skey}.{k}")
                for a, b in mapping.items():
                    _string(a, f"{skey}.{k}"), _string(b, f"{skey}.{k}.{a}")
            parsed.append(
                {"model": model, "wire": dict(step.get("wire", {})), "bind": dict(step.get("bind", {})), "name": step.get("name")}
            )
        autograd = _boolean(group["autograd"], f"{key}.autograd") if "autograd" in group else None
        groups.append({"steps": parsed, "autograd": autograd})
    unused = [m for m in models if m not in used]
    if unused:
        raise ConfigError(f"models.{unused[0]}", "is not used by any group; add it to 'groups' or remove it")
    return groups


def _parse_domain(value) -> dict:
    section = dict(_mapping(value if value is not None else {}, "domain"))
    _known_keys(section, _DOMAIN, "domain")
    out = {**_DOMAIN, **section}
    if out["grid"] is not None:
        grid = out["grid"]
        if not (isinstance(grid, list) and len(grid) == 3):
            raise ConfigError("domain.grid", f"must be null or three positive integers [px, py, pz], got {grid!r}")
        out["grid"] = tuple(_number(g, "domain.grid", integer=True, minimum=1) for g in grid)
    out["skin"] = float(_number(out["skin"], "domain.skin", minimum=0.0))
    if out["halo"] not in ("per_model", "max"):
        raise ConfigError("domain.halo", f"must be 'per_model' or 'max', got {out['halo']!r}")
    out["timeout"] = float(_number(out["timeout"], "domain.timeout", positive=True))
    return out


def integrator_class(kind: str, key: str = "integrator.type"):
    from .dynamics import integrators

    if kind not in INTEGRATOR_TYPES:
        raise ConfigError(key, f"unknown integrator {kind!r}; choose one of {', '.join(INTEGRATOR_TYPES)}")
    return getattr(integrators, INTEGRATOR_TYPES[kind])


def _parse_integrator(value) -> dict:
    section = dict(_mapping(value, "integrator"))
    if "type" not in section:
        raise ConfigError("integrator.type", f"missing; choose one of {', '.join(INTEGRATOR_TYPES)}")
    kind = section.pop("type")
    cls = integrator_class(kind)
    _check_parameters(cls, section, "integrator")
    signature = inspect.signature(cls.__init__)
    for name, param in list(signature.parameters.items())[1:]:
        if param.default is inspect.Parameter.empty and name not in section:
            raise ConfigError(f"integrator.{name}", f"missing (required by {kind})")
    positive = {"timestep", "friction", "tdamp", "fmax", "max_step", "max_timestep", "f_inc", "f_dec", "alpha_start", "f_alpha"}
    for name, v in section.items():
        if v is not None:
            _number(
                v,
                f"integrator.{name}",
                integer=name in ("seed", "chain", "substeps", "n_min"),
                positive=name in positive,
                minimum=0 if name == "temperature" else None,
            )
    try:
        cls(**section)
    except ValueError as exc:
        raise ConfigError("integrator", str(exc)) from exc
    return {"type": kind, "params": section}


def _parse_outputs(value, name: str) -> dict:
    section = dict(_mapping(value if value is not None else {}, "outputs"))
    _known_keys(section, _OUTPUTS, "outputs")
    out = {**_OUTPUTS, **section}
    out["directory"] = _string(out["directory"], "outputs.directory") if out["directory"] is not None else f"runs/{name}"
    for k in ("thermo_every", "trajectory_every", "checkpoint_every"):
        out[k] = _number(out[k], f"outputs.{k}", integer=True, minimum=0)
    for k in ("progress", "plot", "pressure"):
        out[k] = _boolean(out[k], f"outputs.{k}")
    if out["plot"] and not out["thermo_every"]:
        raise ConfigError("outputs.plot", "the plot is made from the thermo log; set outputs.thermo_every > 0 or plot: false")
    return out


# -------------------------------------------------------------------- config
@dataclass
class RunConfig:
    """A validated configuration; ``data`` is plain (picklable) and complete with defaults.

    Build the pieces with :meth:`build_system` (rank 0), :meth:`build_pipeline`,
    :meth:`build_integrator` and :meth:`domain_config`.
    """

    data: dict
    source: str = "<config>"

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def steps(self) -> int:
        return self.data["steps"]

    @property
    def nproc(self) -> int:
        return self.data["nproc"]

    @property
    def outputs(self) -> dict:
        return self.data["outputs"]

    @property
    def dtype(self) -> torch.dtype:
        return {"float64": torch.float64, "float32": torch.float32}[self.data["precision"]]

    @property
    def device(self) -> torch.device:
        kind = self.data["device"]
        if kind == "cuda" and torch.distributed.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)

    def with_steps(self, steps: int) -> RunConfig:
        data = copy.deepcopy(self.data)
        data["steps"] = int(_number(steps, "steps", integer=True, minimum=0))
        return RunConfig(data, self.source)

    def build_system(self):
        """The initial :class:`~halopipe.System` (velocities not yet drawn; see ``system.velocities``)."""
        from .system import System

        spec = self.data["system"]
        if "file" in spec:
            import ase.io

            try:
                atoms = ase.io.read(spec["file"], index=spec["index"], format=spec["format"])
            except Exception as exc:  # ASE raises many kinds
                raise ConfigError("system.file", f"ASE could not read {spec['file']!r}: {exc}") from exc
            system = System.from_ase(atoms, dtype=self.dtype)
        else:
            system = _generate(spec["generator"], self.dtype)
        if "charges" in spec:
            z = system.numbers
            missing = sorted({int(x) for x in z.unique()} - set(spec["charges"]))
            if missing:
                raise ConfigError("system.charges", f"no charge given for atomic number(s) {missing}")
            table = torch.zeros(119, dtype=system.dtype)
            for zz, q in spec["charges"].items():
                table[zz] = q
            fields = dict(system.fields)
            fields["charges"] = table[z]
            system = system.replace(fields=fields)
        return system.to(device=self.device)

    def build_models(self) -> dict:
        models = {}
        for name, spec in self.data["models"].items():
            cls = resolve_model_type(spec["type"], f"models.{name}.type")
            models[name] = _construct(cls, dict(spec["params"]), f"models.{name}")
        return models

    def build_pipeline(self):
        """The composite :class:`~halopipe.Pipeline` of the configured models and groups."""
        from .pipeline import Group, Pipeline, Step

        models = self.build_models()
        try:
            if self.data["groups"] is None:
                pipeline = Pipeline([Step(m, name=n) for n, m in models.items()], config=self.domain_config())
            else:
                groups = []
                for spec in self.data["groups"]:
                    steps = [Step(models[s["model"]], wire=s["wire"], bind=s["bind"], name=s["name"] or s["model"]) for s in spec["steps"]]
                    autograd = spec["autograd"]
                    if autograd is None:
                        autograd = not all(s.model.direct_forces and not s.model.outputs for s in steps)
                    groups.append(Group(steps, autograd=autograd))
                pipeline = Pipeline(groups, config=self.domain_config())
        except (ValueError, TypeError) as exc:
            raise ConfigError("groups", str(exc)) from exc
        return pipeline.to(dtype=self.dtype, device=self.device)

    def build_integrator(self):
        spec = self.data["integrator"]
        return integrator_class(spec["type"])(**spec["params"])

    def domain_config(self):
        from .domain import DomainConfig

        d = self.data["domain"]
        return DomainConfig(grid=d["grid"], skin=d["skin"], halo=d["halo"], timeout=d["timeout"])

    def check_fields(self, system) -> None:
        """The system must carry every field the models consume and no step produces."""
        pipeline = self.build_pipeline()
        missing = sorted(pipeline.required_fields() - set(system.fields))
        if missing:
            raise ConfigError(
                "system",
                f"the models need per-atom field(s) {missing} that no step produces; give system.charges, "
                "a structure file with them, or wire a model that produces them",
            )


def _generate(spec: dict, dtype: torch.dtype):
    if spec["type"] == "nacl":
        from .demo import demo_system

        return demo_system(cells=spec["cells"], seed=spec["seed"], dtype=dtype, rattle=spec["rattle"])
    import numpy as np
    from ase.build import bulk

    from .system import System

    atoms = bulk("Ar", "fcc", a=spec["lattice"], cubic=True).repeat((spec["cells"],) * 3)
    if spec["rattle"] > 0:
        atoms.positions += np.random.default_rng(spec["seed"]).normal(scale=spec["rattle"], size=atoms.positions.shape)
    return System.from_ase(atoms, dtype=dtype)


def parse_config(data, base: str | Path = ".", source: str = "<config>", check_system: bool = True) -> RunConfig:
    """Validate a configuration mapping (as loaded from YAML) and fill in defaults.

    Parameters
    ----------
    data : the mapping.
    base : directory relative paths are resolved against.
    source : name used for the default run name and in messages.
    check_system : also build the system and models once to check the fields
        the models need (reads the structure file).
    """
    data = _mapping(data, "")
    _known_keys(data, _TOP, "")
    for required in ("system", "models", "integrator", "steps"):
        if required not in data:
            raise ConfigError(required, "missing (required)")
    base = Path(base)
    name = _string(data.get("name", Path(source).stem if source != "<config>" else "run"), "name")
    if "/" in name or name.startswith("."):
        raise ConfigError("name", f"must be a plain directory name, got {name!r}")
    models = _parse_models(data["models"])
    out = {
        "name": name,
        "system": _parse_system(data["system"], base),
        "models": models,
        "groups": _parse_groups(data.get("groups"), models),
        "domain": _parse_domain(data.get("domain")),
        "integrator": _parse_integrator(data["integrator"]),
        "steps": _number(data["steps"], "steps", integer=True, minimum=0),
        "nproc": _number(data.get("nproc", 1), "nproc", integer=True, minimum=1),
        "outputs": _parse_outputs(data.get("outputs"), name),
        "precision": data.get("precision", "float64"),
        "device": data.get("device", "cpu"),
    }
    if out["precision"] not in ("float64", "float32"):
        raise ConfigError("precision", f"must be 'float64' or 'float32', got {out['precision']!r}")
    if out["device"] not in ("cpu", "cuda"):
        raise ConfigError("device", f"must be 'cpu' or 'cuda', got {out['device']!r}")
    if out["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "'cuda' requested but torch sees no CUDA device")
    directory = Path(out["outputs"]["directory"]).expanduser()
    out["outputs"]["directory"] = str(directory if directory.is_absolute() else Path.cwd() / directory)
    config = RunConfig(out, source)
    config.build_pipeline()  # constructs every model: bad parameter values fail here, naming the model
    if check_system:
        config.check_fields(config.build_system())
    return config


def load_config(path: str | Path, check_system: bool = True) -> RunConfig:
    """Read and validate a YAML configuration file (see the module docstring)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError("<file>", f"configuration file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from exc
    return parse_config(data if data is not None else {}, base=path.parent, source=str(path), check_system=check_system)
