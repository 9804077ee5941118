"""Configuration errors for people: one line, naming the full key (``models.lj.cutoff``).

pydantic reports every problem with a location such as ``('models', 'lj', 'LennardJonesSpec', 'cutoff')``,
where some entries are the names of union members rather than keys. :func:`config_error` walks the location
along the user's own data, keeps the keys that are really there and rewrites pydantic's message in the words
of a configuration file ("must be >= 0, got -1").
"""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["ConfigError", "config_error", "join_key"]


class ConfigError(ValueError):
    """A configuration problem; the message starts with the offending key.

    Parameters
    ----------
    key : the full key path, e.g. ``models.lj.cutoff`` or ``groups[0].steps[1].model``.
    message : what is wrong and what to do.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key '{key}': {message}")
        self.key, self.message = key, message


def join_key(prefix: str, key: str) -> str:
    """``models.lj`` + ``cutoff`` -> ``models.lj.cutoff``; list indices and empty parts join without a dot."""
    if not prefix or not key:
        return prefix or key
    return prefix + key if key.startswith("[") else f"{prefix}.{key}"


def _short(value) -> str:
    """A value as the user wrote it, cut short so that no file contents end up in a message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} {text[:50]}..."


def _key(loc: tuple, data, missing: bool) -> str:
    """The user's key path of a pydantic location: entries absent from ``data`` are union tags, except a missing key."""
    key, node = "", data
    for position, entry in enumerate(loc):
        last = position == len(loc) - 1
        if isinstance(node, dict) and entry in node:
            key, node = join_key(key, str(entry)), node[entry]
        elif isinstance(node, list) and isinstance(entry, int) and 0 <= entry < len(node):
            key, node = f"{key}[{entry}]", node[entry]
        elif isinstance(node, dict) and last and missing:
            key = join_key(key, str(entry))
    return key


_WANTS = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "list_type": "must be a list",
}


def _message(error: dict) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind == "missing":
        return "missing (required)"
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit}, got {_short(value)}"
    if kind in ("too_short", "too_long"):
        low, high = ctx.get("min_length"), ctx.get("max_length")
        size = f"exactly {low}" if low == high else f"at least {low}" if kind == "too_short" else f"at most {high}"
        return f"must have {size} item(s), got {_short(value)}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {_short(value)}"
    return f"{_WANTS.get(kind, error['msg'])}, got {_short(value)}"


def _unknown_type(key: str, error: dict) -> tuple[str, str]:
    """A tagged union found no member: the ``type`` key is missing, unknown, or the entry is not a mapping."""
    unknown, _, choices = error["msg"].partition("; ")  # "unknown model type; choose one of ..." (see fields.tagged_union)
    value = error["input"]
    if not isinstance(value, dict):
        return key, f"must be a mapping with a 'type' key ({choices}), got {_short(value)}"
    if "type" not in value:
        return join_key(key, "type"), f"missing; {choices}"
    return join_key(key, "type"), f"{unknown} {_short(value['type'])}; {choices}"


def _translate(error: dict, data) -> tuple[str, str]:
    key = _key(error["loc"], data, missing=error["type"] == "missing")
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):  # raised by our own validators, with a key relative to the location
        return join_key(key, cause.key), cause.message
    if cause is not None:
        return key, str(cause)
    if error["type"] == "unknown_type":
        return _unknown_type(key, error)
    return key, _message(error)


def config_error(exc: ValidationError, data, root: str = "<config>") -> ConfigError:
    """One :class:`ConfigError` for a pydantic ``ValidationError`` raised while validating ``data``.

    The first problem gives the key and message; further problems are listed by key only.
    """
    problems = [_translate(error, data) for error in exc.errors()]
    key, message = problems[0]
    others = sorted({k or root for k, _ in problems[1:]} - {key or root})
    if others:
        message += f" (also: {', '.join(others)})"
    return ConfigError(key or root, message)
