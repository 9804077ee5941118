"""Value types shared by the configuration sections.

Every section is a :class:`Section`: a pydantic model with ``extra="forbid"`` and strict types, so that
``"yes"`` is not a boolean and ``2.5`` is not an integer; numbers must be finite; numpy integers count as
integers. Species are keyed by element symbol (``Na``, also written ``na``) or by pair (``Na-Cl``) and are
kept as canonical symbols until a model is built, when they become atomic numbers.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import numbers
import operator
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, get_args

from ase.data import chemical_symbols
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationInfo, model_validator

from .errors import ConfigError


class Section(BaseModel):
    """A configuration section: unknown keys are errors that name the allowed ones."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        if isinstance(data, dict) and cls.model_config.get("extra") == "forbid":
            allowed = list(cls.model_fields)
            for key in data:
                if key not in allowed:
                    guess = difflib.get_close_matches(str(key), allowed, n=1)
                    hint = f"did you mean '{guess[0]}'? " if guess else ""
                    raise ConfigError(str(key), f"unknown key; {hint}allowed here: {', '.join(allowed)}")
        return data


# ------------------------------------------------------------------ numbers
def _integer(value):
    """numpy (and other Integral) integers -> int; booleans are left for the strict check to reject."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


def _real(value):
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


# Bounds come before the converter, so that the JSON schema shows them as minimum / exclusiveMinimum.
Int = Annotated[int, BeforeValidator(_integer)]
Count = Annotated[int, Field(ge=0), BeforeValidator(_integer)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integer)]
Number = Annotated[float, BeforeValidator(_real)]
Positive = Annotated[float, Field(gt=0), BeforeValidator(_real)]
NonNegative = Annotated[float, Field(ge=0), BeforeValidator(_real)]


# -------------------------------------------------------------------- files
def _existing_file(value: str, info: ValidationInfo) -> str:
    """Resolve against the configuration file's directory (``context['base']``); the file must exist."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path((info.context or {}).get("base", ".")) / path
    if not path.is_file():
        raise ConfigError("", f"file {str(path)!r} does not exist")
    return str(path.absolute())


def import_object(target: str, what: str = "object"):
    """``'package.module:name'`` (or ``'package.module.name'``) -> the object, imported now."""
    module_name, _, attr = target.partition(":") if ":" in target else target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError("", f"{what} {target!r} could not be imported: {exc}") from exc


ExistingFile = Annotated[str, AfterValidator(_existing_file)]


def _compile_options(value: dict) -> dict:
    from ..models.compile import COMPILE_OPTIONS

    unknown = sorted(set(value) - COMPILE_OPTIONS)
    if unknown:
        raise ValueError(f"{unknown} are not torch.compile options halopipe passes on; use some of {sorted(COMPILE_OPTIONS)}")
    return value


CompileOptions = Annotated[dict[str, Any], AfterValidator(_compile_options)]
"""``compile_kwargs``: a subset of :data:`halopipe.models.compile.COMPILE_OPTIONS`."""
ImportPath = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*[.:][A-Za-z_]\w*$", description="'package.module:name'")]


# ------------------------------------------------------------------ species
def _element_number(text: str) -> int:
    """``'Na'``, ``'na'`` or ``'11'`` -> 11; a wrongly capitalised symbol is named as such."""
    if text.isdigit() and 1 <= int(text) < len(chemical_symbols):
        return int(text)
    spelled = text if text in chemical_symbols else text.capitalize() if text.islower() else None
    if spelled in chemical_symbols[1:]:
        return chemical_symbols.index(spelled)
    if text.capitalize() in chemical_symbols[1:]:
        raise ConfigError("", f"{text!r} is not an element symbol; write {text.capitalize()!r} (or {text.lower()!r})")
    raise ConfigError("", f"{text!r} is not an element symbol")


def element_symbol(z: int) -> str:
    return chemical_symbols[z]


def _species_key(value, pairs: bool) -> str:
    """Canonical key: ``'Na'``, or ``'Na-Cl'`` where pairs are allowed; atomic numbers are accepted."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = str(int(value))
    if not isinstance(value, str):
        raise ConfigError("", f"{value!r} is not an element symbol")
    parts = value.split("-")
    if len(parts) > 2 or (len(parts) == 2 and not pairs):
        raise ConfigError("", f"{value!r} is not {'an element symbol or an A-B pair' if pairs else 'an element symbol'}")
    return "-".join(element_symbol(_element_number(p.strip())) for p in parts)


ElementKey = Annotated[str, BeforeValidator(lambda v: _species_key(v, pairs=False))]
PairKey = Annotated[str, BeforeValidator(lambda v: _species_key(v, pairs=True))]
ElementTable = dict[ElementKey, Number]
"""``{element: value}``."""


def _per_species(key) -> Any:
    """One number for every species, or a table keyed by ``key``."""
    members = Annotated[Number, Tag("all species")] | Annotated[dict[key, Number], Tag("per species")]
    return Annotated[members, Discriminator(lambda v: "per species" if isinstance(v, Mapping) else "all species")]


PerElement = _per_species(ElementKey)
"""A number, or ``{element: number}``."""
PerPair = _per_species(PairKey)
"""A number, or ``{element or 'A-B' pair: number}`` (pairs override the mixing rule)."""


def _atomic_numbers_key(key):
    """``'Na'`` -> 11, ``'Na-Cl'`` -> (11, 17) (canonical symbols or numbers only); any other key is returned unchanged."""
    parts = key.split("-") if isinstance(key, str) else []
    if not 1 <= len(parts) <= 2 or not all(p in chemical_symbols[1:] or p.isdigit() for p in parts):
        return key
    zs = tuple(int(p) if p.isdigit() else chemical_symbols.index(p) for p in parts)
    return zs[0] if len(zs) == 1 else zs


def atomic_numbers_of(value):
    """Species keys -> atomic numbers in a mapping; a list -> a tuple; other values unchanged (what models take)."""
    if isinstance(value, Mapping):
        return {_atomic_numbers_key(key): v for key, v in value.items()}
    return tuple(value) if isinstance(value, list) else value


# ----------------------------------------------------------- tagged unions
def type_names(spec: type[BaseModel]) -> tuple[str, ...]:
    """The ``type`` values a section accepts (its ``Literal``)."""
    return get_args(spec.model_fields["type"].annotation)


def tagged_union(specs: Iterable[type[BaseModel]], what: str, fallback: type[BaseModel] | None = None, hint: str = "") -> Any:
    """A union of sections chosen by their ``type`` key; ``fallback`` takes any ``'package.module:Class'`` type.

    An unknown or missing ``type`` is reported once, with the choices (see :mod:`.errors`).
    """
    specs = list(specs)
    tags = {name: spec.__name__ for spec in specs for name in type_names(spec)}

    def choose(value) -> str | None:
        kind = value.get("type") if isinstance(value, Mapping) else getattr(value, "type", None)
        if isinstance(kind, str) and kind in tags:
            return tags[kind]
        if fallback is not None and isinstance(kind, str) and (":" in kind or "." in kind):
            return fallback.__name__
        return None

    members = [Annotated[spec, Tag(spec.__name__)] for spec in specs + ([fallback] if fallback else [])]
    # The message carries the choices (a context dict would make the type unhashable, so not usable in "X | None").
    message = f"unknown {what}; choose one of {', '.join(tags)}{hint}"
    union = functools.reduce(operator.or_, members)
    return Annotated[union, Discriminator(choose, custom_error_type="unknown_type", custom_error_message=message)]
