"""Physics fingerprints: what a checkpoint was computed with, so a restart can tell when it changed.

A restart continues the checkpoint's trajectory with the models, groups and
integrator it is given. If any of them (or the system the run was configured
with) differs from what wrote the checkpoint, the continued trajectory is not
the run the user thinks it is. A fingerprint is a plain nested dict, stored in
the checkpoint and compared key by key on restart:

* ``system``: atom count, species counts (by element symbol), cell, pbc;
* ``models``: per step name, the model type, its public scalar attributes and a
  digest of each parameter and buffer tensor;
* ``groups``: the step names, wiring and evaluation kind of each group;
* ``integrator``: its type and constructor parameters.

Positions and velocities are not part of it: they are the state that moves.
"""

from __future__ import annotations

import hashlib
import inspect
import math

import torch

__all__ = ["system_identity", "pipeline_fingerprint", "integrator_fingerprint", "fingerprint_changes"]

_CELL_TOLERANCE = 1e-8  # Å: a float32 round trip of the cell is not a change
_TENSOR = "tensor"  # prefix of a tensor's digest in a fingerprint


def system_identity(n_atoms: int, species_counts: torch.Tensor, cell: torch.Tensor, pbc: torch.Tensor) -> dict:
    """The identity of a system: atom count, species counts by symbol, cell and pbc.

    Parameters
    ----------
    n_atoms : number of atoms.
    species_counts : (119,) atoms per atomic number.
    cell, pbc : (3, 3) lattice vectors (rows) and (3,) periodicity.
    """
    from ase.data import chemical_symbols

    counts = species_counts.to(torch.int64).tolist()
    return {
        "n_atoms": int(n_atoms),
        "species": {chemical_symbols[z]: int(c) for z, c in enumerate(counts) if c},
        "cell": [[float(x) for x in row] for row in cell.detach().to(torch.float64).cpu().tolist()],
        "pbc": [bool(p) for p in pbc.cpu().tolist()],
    }


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu", torch.float64).contiguous()
    return f"{_TENSOR}{tuple(data.shape)} sha256 {hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]}"


def _scalars(obj) -> dict:
    """Public attributes that are plain numbers, strings or booleans (a model's or integrator's settings)."""
    return {
        k: v for k, v in sorted(vars(obj).items()) if not k.startswith("_") and k != "training" and isinstance(v, (bool, int, float, str))
    }


def pipeline_fingerprint(pipeline) -> tuple[dict, list]:
    """``(models, groups)`` fingerprints of a :class:`~halopipe.Pipeline`, keyed by step name."""
    models, groups = {}, []
    for group, names in zip(pipeline.groups, pipeline.names):
        for step, name in zip(group.steps, names):
            model = step.model
            tensors = {k: _digest(v) for k, v in model.state_dict().items()}
            models[name] = {"type": type(model).__name__, **_scalars(model), **tensors}
        groups.append(
            {
                "steps": list(names),
                "autograd": bool(group.autograd),
                "wire": [dict(s.wire) for s in group.steps],
                "bind": [dict(s.bind) for s in group.steps],
            }
        )
    return models, groups


def integrator_fingerprint(integrator) -> dict:
    """The integrator's type and the values of its constructor parameters."""
    names = list(inspect.signature(type(integrator).__init__).parameters)[1:]
    return {"type": type(integrator).__name__, **{n: getattr(integrator, n) for n in names if hasattr(integrator, n)}}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def _cell_changed(old, new) -> bool:
    return any(abs(a - b) > _CELL_TOLERANCE for ra, rb in zip(old, new) for a, b in zip(ra, rb))


def fingerprint_changes(old: dict, new: dict) -> list[str]:
    """What differs between two fingerprints, one line per changed key (empty when they agree).

    >>> fingerprint_changes({"models": {"lj": {"cutoff": 6.0}}}, {"models": {"lj": {"cutoff": 7.0}}})
    ['models.lj.cutoff: 6.0 -> 7.0']
    """
    old, new = dict(old), dict(new)
    changes = []
    cell_old = old.get("system", {}).get("cell")
    cell_new = new.get("system", {}).get("cell")
    if cell_old is not None and cell_new is not None:
        if _cell_changed(cell_old, cell_new):
            changes.append(f"system.cell: {cell_old} -> {cell_new}")
        old["system"] = {k: v for k, v in old["system"].items() if k != "cell"}
        new["system"] = {k: v for k, v in new["system"].items() if k != "cell"}
    flat_old, flat_new = _flatten(old), _flatten(new)
    for key in sorted(set(flat_old) | set(flat_new), key=lambda k: (k.split(".")[0], k)):
        a, b = flat_old.get(key, "(absent)"), flat_new.get(key, "(absent)")
        if _same(a, b):
            continue
        if isinstance(a, str) and isinstance(b, str) and a.startswith(_TENSOR) and b.startswith(_TENSOR):
            changes.append(f"{key}: tensor values changed")  # digests: their text means nothing to a reader
        else:
            changes.append(f"{key}: {a} -> {b}")
    return changes
