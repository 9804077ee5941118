"""The JSON schema for editors (``config_schema``): valid JSON schema that accepts the examples and rejects mistakes.

Checked twice, independently of pydantic: with ``jsonschema`` (a reference validator) and with a small walk
over the schema's structure (keys, required keys, types) that needs no library.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from halopipe.config import MODEL_TYPES, ConfigError, config_schema, parse_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def example(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def mistakes() -> list[tuple[str, dict]]:
    base = example(EXAMPLES[0])
    cases = [
        ("unknown top-level key", lambda d: d.update(stepz=3)),
        ("missing steps", lambda d: d.pop("steps")),
        ("steps not an integer", lambda d: d.update(steps=2.5)),
        ("unknown model parameter", lambda d: next(iter(d["models"].values())).update(epslon=1.0)),
        ("unknown model type", lambda d: next(iter(d["models"].values())).update(type="LenardJones")),
        ("unknown integrator", lambda d: d["integrator"].update(type="verlett")),
        ("negative skin", lambda d: d.update(domain={"skin": -1.0})),
        ("bad halo", lambda d: d.update(domain={"halo": "wide"})),
        ("unknown outputs key", lambda d: d.update(outputs={"plots": True})),
    ]
    out = []
    for name, mutate in cases:
        data = copy.deepcopy(base)
        mutate(data)
        out.append((name, data))
    return out


# ------------------------------------------------------- a structural check
def _resolve(node: dict, root: dict) -> dict:
    while "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_ok(value, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def problems(value, node: dict, root: dict, path: str = "") -> list[str]:
    """Where ``value`` breaks the schema's keys, required keys, types, constants, patterns and lower bounds."""
    node = _resolve(node, root)
    options = node.get("anyOf") or node.get("oneOf")
    if options:
        found = [problems(value, option, root, path) for option in options]
        return [] if any(not f for f in found) else min(found, key=len)
    if "type" in node and not _type_ok(value, node["type"]):
        return [f"{path}: not {node['type']}"]
    if "const" in node and value != node["const"] or "enum" in node and value not in node["enum"]:
        return [f"{path}: {value!r} not allowed"]
    if "pattern" in node and not re.search(node["pattern"], value):
        return [f"{path}: {value!r} does not match {node['pattern']}"]
    if "minimum" in node and value < node["minimum"] or "exclusiveMinimum" in node and value <= node["exclusiveMinimum"]:
        return [f"{path}: {value!r} below the minimum"]
    out = []
    if isinstance(value, dict):
        out += [f"{path}.{k}: missing" for k in node.get("required", []) if k not in value]
        for key, item in value.items():
            extra = node.get("additionalProperties", True)
            if key in node.get("properties", {}):
                out += problems(item, node["properties"][key], root, f"{path}.{key}")
            elif extra is False:
                out.append(f"{path}.{key}: unknown key")
            elif isinstance(extra, dict):
                out += problems(item, extra, root, f"{path}.{key}")
    if isinstance(value, list) and "items" in node:
        for k, item in enumerate(value):
            out += problems(item, node["items"], root, f"{path}[{k}]")
    return out


# -------------------------------------------------------------------- tests
def test_schema_is_plain_json_with_every_section_and_model_type():
    schema = json.loads(json.dumps(config_schema()))
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert set(schema["required"]) == {"system", "models", "integrator", "steps"}
    entries = schema["properties"]["models"]["additionalProperties"]["oneOf"]
    types = {_resolve(e, schema)["properties"]["type"].get("const") for e in entries}
    assert set(MODEL_TYPES) <= types
    assert {"MACE", "TorchModel", "LennardJones", "DSFCoulomb", "ChargeModel", "DFTD3", "Ewald", "PME"} <= types


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_follow_the_schema_structure(path):
    schema = config_schema()
    assert problems(example(path), schema, schema) == []


@pytest.mark.parametrize("name, data", mistakes(), ids=[m[0] for m in mistakes()])
def test_structure_check_and_loader_both_reject_mistakes(name, data):
    schema = config_schema()
    assert problems(data, schema, schema), name
    with pytest.raises(ConfigError):
        parse_config(data, check_system=False)


def test_jsonschema_accepts_the_examples_and_rejects_mistakes():
    jsonschema = pytest.importorskip("jsonschema")
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in EXAMPLES:
        errors = [e.message for e in validator.iter_errors(example(path))]
        assert errors == [], (path.name, errors)
    for name, data in mistakes():
        assert not validator.is_valid(data), name
