"""A reusable conformance check that every model's tests call.

:func:`check_model` evaluates a model on a system through a single-process
:class:`~halopipe.Pipeline` and checks what any correct model must satisfy:

* forces equal ``-dE/dr`` by central finite differences;
* stress equals the strain derivative ``(1/V) dE/d(strain)`` by finite
  differences (periodic systems);
* energy is invariant under translation and rotation (forces rotate along);
* forces sum to zero;
* direct forces and virial, where offered, equal the autograd ones, and a
  forces-only direct evaluation (``energy=False``, no stress) gives the same
  forces bit for bit, so a trajectory never depends on what is reported;
* produced per-atom fields are invariant under translation and rotation;
* a batch of the system and a strained, rattled copy gives each system's
  energy, forces, stress and fields of a call on it alone (:func:`check_batch`),
  through the batch view (``batchable`` models) or one view per system;
* on a view that owns no atoms (a rank whose brick is empty: vacuum, a cluster
  in a box) the model returns no energies, zero forces and virial, and calls
  the same collectives (``refresh``, ``global_sum``, forward and backward) in
  the same order as on a populated view, so its peers are never left waiting
  (:func:`check_empty_view`).

Run it in float64: tolerances are set for that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from .batch import Batch
from .domain import LocalDomain
from .models.base import LocalView
from .neighbors import GroupedPairs
from .pipeline import Group, Pipeline, Step, build_view
from .system import System

__all__ = ["check_batch", "check_empty_view", "check_model", "finite_difference_forces", "finite_difference_stress", "random_rotation"]


def _energy(pipeline: Pipeline, system: System) -> float:
    return float(pipeline(system)["energy"])


def finite_difference_forces(pipeline: Pipeline, system: System, atoms, h: float = 1e-5) -> torch.Tensor:
    """Central-difference forces ``-dE/dr`` on the listed atoms, (len(atoms), 3)."""
    out = torch.zeros(len(atoms), 3, dtype=torch.float64)
    for k, i in enumerate(atoms):
        for a in range(3):
            plus, minus = system.positions.clone(), system.positions.clone()
            plus[i, a] += h
            minus[i, a] -= h
            ep = _energy(pipeline, system.replace(positions=plus))
            em = _energy(pipeline, system.replace(positions=minus))
            out[k, a] = -(ep - em) / (2 * h)
    return out


def finite_difference_stress(pipeline: Pipeline, system: System, h: float = 1e-6) -> torch.Tensor:
    """``(1/V) dE/d(strain)`` by central differences on a symmetric strain."""
    volume = system.volume
    out = torch.zeros(3, 3, dtype=torch.float64)
    eye = torch.eye(3, dtype=system.dtype)
    for a in range(3):
        for b in range(a, 3):
            e = torch.zeros(3, 3, dtype=system.dtype)
            e[a, b] = e[b, a] = h
            vals = []
            for sign in (1.0, -1.0):
                strain = eye + sign * e
                s = system.replace(positions=system.positions @ strain, cell=system.cell @ strain)
                vals.append(_energy(pipeline, s))
            d = (vals[0] - vals[1]) / (2 * h)
            if a != b:
                d /= 2.0  # symmetric strain moves two components at once
            out[a, b] = out[b, a] = d / volume
    return out


def random_rotation(seed: int = 0) -> torch.Tensor:
    """A proper rotation matrix drawn from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def _close(name: str, got, want, atol: float, rtol: float, report: dict) -> None:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    err = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    report[name] = err
    if not err <= atol + rtol * scale:
        raise AssertionError(f"check_model: {name} differs by {err:.3e} (atol {atol:g}, rtol {rtol:g}, scale {scale:.3e})")


def check_model(
    model,
    system: System,
    *,
    n_fd_atoms: int = 4,
    fd_step: float = 1e-5,
    force_atol: float = 1e-6,
    stress_atol: float = 1e-7,
    atol: float = 1e-9,
    seed: int = 0,
) -> dict:
    """Check a model's conformance on ``system``; raises ``AssertionError``.

    Parameters
    ----------
    model : a :class:`~halopipe.models.Model`.
    system : float64 system carrying every input field the model needs.
    n_fd_atoms : atoms whose forces are checked by finite differences.
    force_atol, stress_atol : tolerances against finite differences (eV/Å, eV/Å³).
    atol : tolerance of exact identities (invariances, direct vs autograd),
        relative to the size of the compared quantity.

    Returns
    -------
    dict of the largest error seen in each check.
    """
    report: dict[str, float] = {}
    check_empty_view(model, system)
    pipe = Pipeline([Group([Step(model)], autograd=True)])
    periodic = bool(system.pbc.all())
    ref = pipe(system, stress=periodic)
    energy, forces = float(ref["energy"]), ref["forces"]

    # Forces against central differences of the energy.
    g = torch.Generator().manual_seed(seed)
    atoms = torch.randperm(system.n_atoms, generator=g)[: min(n_fd_atoms, system.n_atoms)].tolist()
    fd = finite_difference_forces(pipe, system, atoms, h=fd_step)
    _close("forces_vs_finite_differences", forces[atoms], fd, force_atol, 1e-6, report)

    if periodic:
        fd_stress = finite_difference_stress(pipe, system)
        _close("stress_vs_finite_differences", ref["stress"], fd_stress, stress_atol, 1e-6, report)

    # Forces sum to zero (translation invariance of the energy).
    _close("net_force", forces.sum(dim=0), torch.zeros(3), atol * max(1.0, float(forces.abs().sum())), 0.0, report)

    # Translation.
    shift = torch.tensor([0.37, -1.21, 2.05], dtype=system.dtype)
    moved = pipe(system.replace(positions=system.positions + shift))
    scale = max(1.0, abs(energy))
    _close("translation_energy", moved["energy"], energy, atol * scale, 0.0, report)
    _check_fields("translation", model, moved, ref, atol, report)

    # Rotation of positions and cell together.
    rot = random_rotation(seed).to(system.dtype)
    rotated = pipe(system.replace(positions=system.positions @ rot.T, cell=system.cell @ rot.T, fields=_rotate_fields(system.fields, rot)))
    _close("rotation_energy", rotated["energy"], energy, atol * scale, 0.0, report)
    _close("rotation_forces", rotated["forces"], forces @ rot.T, atol * max(1.0, float(forces.abs().max())), 0.0, report)
    _check_fields("rotation", model, rotated, ref, atol, report)

    if model.direct_forces:
        direct = Pipeline([Group([Step(model)], autograd=False)])(system, stress=periodic)
        _close("direct_energy", direct["energy"], energy, atol * scale, 0.0, report)
        _close("direct_forces", direct["forces"], forces, atol * max(1.0, float(forces.abs().max())), 0.0, report)
        if periodic:
            _close("direct_stress", direct["stress"], ref["stress"], atol * max(1e-3, float(ref["stress"].abs().max())), 0.0, report)
        _check_forces_only(model, system, direct["forces"], report)
    check_batch(model, system, atol=atol, seed=seed, report=report)
    if not math.isfinite(energy):
        raise AssertionError(f"check_model: energy is not finite ({energy})")
    return report


def check_batch(model, system: System, *, atol: float = 1e-9, seed: int = 0, report: dict | None = None) -> dict:
    """``pipeline([system, variant])`` equals a call on each alone; raises ``AssertionError``.

    ``variant`` is ``system`` rattled by 0.02 Å and, when periodic, under an
    anisotropic 1 % strain, so the two systems differ in cell and images.
    Checked for the model in an autograd group and, when it offers direct
    forces, in a direct group: per-system energy, forces, stress (periodic
    systems) and produced fields, to ``atol`` relative to their size.
    """
    report = {} if report is None else report
    g = torch.Generator().manual_seed(seed + 1)
    strain = torch.eye(3, dtype=system.dtype) + (torch.diag(torch.tensor([0.01, -0.006, 0.008])) if bool(system.pbc.any()) else 0.0)
    moved = system.positions @ strain + 0.02 * torch.randn(system.positions.shape, generator=g).to(system.dtype)
    systems = [system, system.replace(positions=moved, cell=system.cell @ strain)]
    periodic = bool(system.pbc.all())
    for autograd in (True, False) if model.direct_forces else (True,):
        pipe = Pipeline([Group([Step(model)], autograd=autograd)])
        kind = "autograd" if autograd else "direct"
        together = pipe(systems, stress=periodic)
        for b, (one, part) in enumerate(zip(systems, Batch(systems).split(together))):
            alone = pipe(one, stress=periodic)
            label = f"batch_{kind}_system{b}"
            _close(f"{label}_energy", part["energy"], alone["energy"], atol * max(1.0, abs(float(alone["energy"]))), 0.0, report)
            _close(f"{label}_forces", part["forces"], alone["forces"], atol * max(1.0, float(alone["forces"].abs().max())), 0.0, report)
            if periodic:
                scale = max(1e-3, float(alone["stress"].abs().max()))
                _close(f"{label}_stress", part["stress"], alone["stress"], atol * scale, 0.0, report)
            for name in sorted(model.outputs):
                value = alone["fields"][name]
                _close(f"{label}_{name}", part["fields"][name], value, atol * max(1.0, float(value.abs().max())), 0.0, report)
    return report


def _check_forces_only(model, system: System, forces: torch.Tensor, report: dict) -> None:
    """A direct evaluation asked for forces only leaves the energies out and gives bitwise the full evaluation's forces."""
    out = Pipeline([Group([Step(model)], autograd=False)])(system, energy=False)
    if "energy" in out or "energies" in out:
        raise AssertionError("check_model: a forces-only evaluation (energy=False) returned energies")
    if not torch.equal(out["forces"], forces):
        err = float((out["forces"] - forces).abs().max())
        raise AssertionError(f"check_model: forces-only direct forces differ from the full evaluation's by {err:.3e} (they must be equal)")
    report["direct_forces_only"] = 0.0


def _rotate_fields(fields: dict, rot: torch.Tensor) -> dict:
    """Vector fields (N, 3) rotate with the system; scalars stay."""
    return {k: (v @ rot.T if v.ndim == 2 and v.shape[1] == 3 and v.is_floating_point() else v) for k, v in fields.items()}


def _check_fields(label: str, model, got: dict, ref: dict, atol: float, report: dict) -> None:
    for name in sorted(model.outputs):
        a, b = got["fields"][name], ref["fields"][name]
        if a.ndim == 1:
            _close(f"{label}_{name}", a, b, atol * max(1.0, float(b.abs().max())), 0.0, report)


# ----------------------------------------------------------------------------- empty views
Collective = Callable[[torch.Tensor], torch.Tensor]


def _recorded(collective: Collective, label: str, log: list, per_row: bool) -> Collective:
    """``collective`` that logs each call and each time its backward runs (a gradient reaches its output).

    The logged shape is what must agree across ranks: the trailing shape of a
    per-row tensor (``per_row``), the whole shape otherwise.
    """

    def call(x: torch.Tensor) -> torch.Tensor:
        entry = f"{label}{tuple(x.shape[1:] if per_row else x.shape)}"
        log.append(entry)
        y = collective(x).clone()  # a node of our own to hook, even for an identity
        if y.requires_grad:
            y.register_hook(lambda grad: log.append(f"{entry}.backward"))
        return y

    return call


def _collectives(model, view: LocalView, direct: bool) -> tuple[list[str], object, torch.Tensor]:
    """Run ``model`` on ``view`` (plus the backward an autograd group does); the collectives it called, output, dE/drows."""
    log: list[str] = []
    rows = view.positions.detach().requires_grad_(True)
    vectors = rows[view.pairs[1]] - rows[view.pairs[0]]
    view = view.replace(
        positions=rows,
        vectors=vectors,
        distances=vectors.norm(dim=1),
        refresh=_recorded(view.refresh, "refresh", log, per_row=True),
        global_sum=_recorded(view.global_sum, "global_sum", log, per_row=False),
        fold=_recorded(view.fold, "fold", log, per_row=True),
    )
    if direct:
        with torch.no_grad():
            out = model(view, direct=True)
        return log, out, torch.zeros_like(rows)
    out = model(view)
    total = out.energies.sum() + 0.0 * rows.sum()  # as the pipeline does, so a rank without atoms has a graph
    (grad,) = torch.autograd.grad(total, rows, allow_unused=True)
    return log, out, torch.zeros_like(rows) if grad is None else grad


def _empty_views(model, system: System) -> tuple[LocalView, list[LocalView]]:
    """A populated single-process view of ``system`` and two views owning no atoms.

    The first empty view keeps every row of the populated one as a ghost (an
    empty brick next to the atoms), the second has no rows at all (an empty
    brick far from them). Their ``refresh`` fills ghost rows with zeros and
    their ``fold`` returns no rows: what a rank without atoms receives does
    not matter, only that it asks for it.
    """
    domain = LocalDomain(system)
    domain.prepare(model.halo)
    positions = system.positions.detach()
    full = build_view(domain, Step(model), model.halo, positions, system.cell, dict(system.fields))
    views = []
    for rows in (full.n_rows, 0):

        def refresh(x: torch.Tensor, rows: int = rows) -> torch.Tensor:
            return torch.cat([x, x.new_zeros((rows,) + tuple(x.shape[1:]))])

        views.append(
            replace(
                full,
                positions=full.positions.detach()[:rows],
                numbers=full.numbers[:rows],
                n_owned=0,
                pairs=full.pairs[:, :0],
                vectors=None if full.vectors is None else full.vectors.detach()[:0],  # half lists carry no vectors
                distances=None if full.distances is None else full.distances.detach()[:0],
                fields={k: v.detach()[:rows] for k, v in full.fields.items()},
                refresh=refresh,
                global_sum=lambda x: x,
                fold=lambda x: x[:0],  # no owned rows to fold into, but a graph as a rank's fold has
                one_holder=None if full.one_holder is None else (lambda: GroupedPairs.empty(0, full.positions.device)),
                ids=full.ids[:rows],
            )
        )
    return full, views


def check_empty_view(model, system: System) -> None:
    """Check ``model`` on views that own no atoms; raises ``AssertionError``.

    Under domain decomposition a rank whose brick holds no atom still runs
    every model: it must return no energies (zero-length), zero direct forces
    and virial, finite zero gradients, and call the same collectives, forward
    and backward, in the same order as a rank with atoms, or its peers wait
    for it forever. The reference order comes from a populated view of
    ``system`` (one process).
    """
    full, empties = _empty_views(model, system)
    for direct in (False, True) if model.direct_forces else (False,):
        want, _, _ = _collectives(model, full, direct)
        for view in empties:
            where = f"check_model: on a view owning no atoms and {view.n_rows} ghost rows{' (direct)' if direct else ''}"
            try:
                got, out, grad = _collectives(model, view, direct)
            except Exception as exc:
                raise AssertionError(f"{where}, {model.name} raised {type(exc).__name__}: {exc}") from exc
            if got != want:
                raise AssertionError(f"{where}, {model.name} calls the collectives {got}, but {want} with atoms: its peers would hang")
            rows = tuple(out.energies.shape)  # none, or zeros on the ghost rows (a pair model's shares: :class:`ModelOutput`)
            if rows not in ((0,), (view.n_rows,)) or not bool((out.energies == 0).all()):
                zeros = f"zeros on its {view.n_rows} rows"
                raise AssertionError(f"{where}, {model.name} returned energies of shape {rows}, not (0,) nor {zeros}")
            for name, value in out.fields.items():
                if value.shape[0] != 0:
                    raise AssertionError(f"{where}, {model.name} produced field {name!r} with {value.shape[0]} rows, not 0")
            if not bool((grad == 0).all()):
                raise AssertionError(f"{where}, the gradient of {model.name}'s energy is not zero on every row")
            if direct:
                rows = view.n_rows if model.ghost_forces else 0  # forces of owned rows only: none
                if out.forces is None or tuple(out.forces.shape) != (rows, 3) or not bool((out.forces == 0).all()):
                    raise AssertionError(f"{where}, {model.name}'s direct forces are not zero on its {rows} rows")
                if out.virial is None or not bool((out.virial == 0).all()):
                    raise AssertionError(f"{where}, {model.name}'s virial is not zero")
