"""Composing models: steps, groups and the pipeline, one potential for 1 or N ranks.

A :class:`Pipeline` is a list of :class:`Group` s run in order; energies,
forces and stress add over groups.

* A **direct group** asks each model for its own forces and virial and sums
  them; no graph is built.
* An **autograd group** sums its models' energies and differentiates once:
  forces are ``-dE/dr`` and stress the derivative with respect to a strain
  applied to positions and cell together.
* A **wired field** is a per-atom field produced by one step (say ``charges``
  from a charge model) and consumed by a later step of the same autograd group
  (say Ewald). It is passed with its graph, so the cross-model chain term
  ``dE/dq * dq/dr`` is part of the forces and the stress.
* **Field gradients** (``field_gradients=[...]``): the derivative of the
  energy with respect to a per-atom field, the system's (input) or a wired
  one, from the same backward pass as the forces (see :class:`Pipeline`).

A group is direct when every model offers direct forces and no field is
produced in it; otherwise it is autograd (``Group(autograd=...)`` overrides).

The evaluation (:func:`evaluate`) is written against the
:class:`~halopipe.domain.Domain` interface, so the very same code runs on a
single process (:class:`~halopipe.domain.LocalDomain`) and on a domain split
over ranks. The core never imports ``halopipe.distributed``: calling a pipeline
on any :class:`~halopipe.domain.Domain` (a ``ShardedSystem`` is one) runs on
it, and a plain :class:`~halopipe.System` under a process group of several
ranks is split by the decomposition that ``halopipe.distributed`` installs with
:func:`register_decomposition` when it is imported (``import halopipe`` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .domain import Domain, DomainConfig, LocalDomain
from .models.base import LocalView, Model, NonFiniteError
from .neighbors import grouped_owned_half_pairs, narrower_half_pairs, owned_pairs, pair_vectors
from .system import System

__all__ = ["Step", "Group", "Pipeline", "evaluate", "build_view", "register_decomposition", "RESERVED_NAMES"]

RESERVED_NAMES = frozenset({"energy", "energies", "model_energies", "forces", "stress", "virial", "fields", "halo"})
"""Keys of a pipeline result; no field may be named like one."""

Decomposition = Callable[[System | None, DomainConfig], Domain | None]
_decomposition: Decomposition | None = None


def register_decomposition(decompose: Decomposition | None) -> None:
    """Install how a :class:`~halopipe.System` is split over the ranks of a running process group.

    ``decompose(system_or_None, config)`` is called collectively by every rank
    and returns the rank's :class:`~halopipe.domain.Domain`, or ``None`` when
    no process group of more than one rank is running (then the pipeline runs
    on one process). ``halopipe.distributed`` registers its scatter on import,
    so the core depends on the interface only.
    """
    global _decomposition
    _decomposition = decompose


@dataclass
class Step:
    """One model in a group.

    Parameters
    ----------
    model : the :class:`~halopipe.models.Model`.
    wire : renames produced fields before later steps see them,
        ``{produced_name: visible_name}``.
    bind : where the model's inputs come from, ``{input_name: visible_name}``
        (default: the same name).
    name : label of this step's energy in results (default: model class name).
    """

    model: Model
    wire: dict[str, str] = field(default_factory=dict)
    bind: dict[str, str] = field(default_factory=dict)
    name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise TypeError(f"Step: expected a halopipe Model, got {type(self.model).__name__}")
        visible = {f"input '{i}'": self.source_of(i) for i in sorted(self.model.inputs)}
        visible.update({f"output '{o}'": v for o, v in self.produced().items()})
        for role, name in visible.items():
            if name in RESERVED_NAMES:
                raise ValueError(
                    f"Step: {self.model.name}'s {role} is named '{name}', a reserved result key {sorted(RESERVED_NAMES)}; "
                    f"rename it with wire={{...: 'q'}} or bind={{...: 'q'}}"
                )

    def source_of(self, input_name: str) -> str:
        return self.bind.get(input_name, input_name)

    def produced(self) -> dict[str, str]:
        """Model output name -> name visible to later steps."""
        return {out: self.wire.get(out, out) for out in sorted(self.model.outputs)}


@dataclass
class Group:
    """Steps evaluated together; see the module docstring for the two kinds.

    ``autograd=None`` (default) infers the kind: direct when every model offers
    direct forces and none produces a field, autograd otherwise.
    """

    steps: list[Step]
    autograd: bool | None = None

    def __post_init__(self) -> None:
        self.steps = [s if isinstance(s, Step) else Step(s) for s in self.steps]
        if not self.steps:
            raise ValueError("Group: a group needs at least one step")
        if self.autograd is None:
            self.autograd = not all(s.model.direct_forces and not s.model.outputs for s in self.steps)
        if not self.autograd:
            for s in self.steps:
                if not s.model.direct_forces:
                    raise ValueError(
                        f"Group: {s.model.name} does not offer direct forces and cannot be in a direct group (autograd=False); "
                        "put it in an autograd group"
                    )


def _as_groups(items) -> list[Group]:
    groups = []
    for item in items:
        if isinstance(item, Group):
            groups.append(item)
        elif isinstance(item, (Step, Model)):
            groups.append(Group([item]))
        else:
            raise TypeError(f"Pipeline: expected Group, Step or Model, got {type(item).__name__}")
    return groups


def _check_wiring(groups: list[Group]) -> None:
    """Reject wiring whose chain term would be lost, at construction time."""
    produced_in: dict[str, int] = {}
    for g, group in enumerate(groups):
        local: set[str] = set()
        for step in group.steps:
            for inp in sorted(step.model.inputs):
                src = step.source_of(inp)
                if src in local:
                    continue
                if src in produced_in:
                    where = produced_in[src]
                    kind = "a direct group" if not group.autograd else "another group"
                    raise ValueError(
                        f"Pipeline: field '{src}' is produced in group {where} and consumed by {step.model.name} in {kind} "
                        f"(group {g}); the chain term dE/d{src} * d{src}/dr would be lost. Put producer and consumer in one autograd group."
                    )
            for visible in step.produced().values():
                if not group.autograd:
                    raise ValueError(
                        f"Pipeline: {step.model.name} produces '{visible}' in a direct group; producers belong in autograd groups"
                    )
                local.add(visible)
        for name in local:
            produced_in.setdefault(name, g)


def _unique_names(groups: list[Group]) -> list[list[str]]:
    seen: dict[str, int] = {}
    names = []
    for group in groups:
        row = []
        for step in group.steps:
            base = step.name or step.model.name
            seen[base] = seen.get(base, 0) + 1
            row.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
        names.append(row)
    return names


class Pipeline(torch.nn.Module):
    """A composite potential: groups of models evaluated in order, on one process or many.

    Parameters
    ----------
    groups : list of :class:`Group` (a bare :class:`Step` or model becomes its
        own group, its kind inferred).
    config : :class:`~halopipe.domain.DomainConfig`: the skin (plans and
        lists are reused until some atom moved more than ``skin / 2``), the
        brick grid, the halo mode and the timeout; default ``DomainConfig()``.

    Calling ``pipeline(system, stress=False, energy=True)`` evaluates

    * a :class:`~halopipe.System` on this process, or, under a process group
      of several ranks, split over them (pass the system on rank 0; other
      ranks may pass it too, or ``None``); results cover all atoms, on every rank;
    * a :class:`~halopipe.domain.Domain` such as a ``ShardedSystem`` as it is
      (the way molecular dynamics keeps its decomposition between steps);
      per-atom results cover the owned atoms.

    It returns a dict: ``energy`` (total, eV), ``energies`` (per atom, eV),
    ``model_energies`` (per step name, eV), ``forces`` (eV/Å), ``stress``
    (3, 3, eV/Å³, ASE sign) and ``virial`` (eV) when asked, ``fields`` (the
    produced per-atom fields, by visible name) and ``halo`` (ghost rows each
    step saw on this rank, and ``exchanged``: rows the plan holds).
    ``energy=False`` asks for forces only, as most MD steps do (LAMMPS
    evaluates energies only on thermo steps): the three energy keys are left
    out, and direct models may skip their energy work; the forces are the same.

    ``field_gradients=["charges", ...]`` adds ``d_energy_d_<name>`` for each
    named per-atom field: shaped like the field, per atom in the order of
    ``forces`` (gathered on every rank as they are), eV per field unit, at
    fixed positions and cell. For a field the **system carries** it is
    ``dE/dx_i``, the total energy's derivative, summed over every step and
    group that reads it. For a **wired field** (produced by one step,
    consumed by later steps of its group) it is the *downstream partial*
    ``dE/dq_i``: ``q`` is made an independent variable at the point of
    wiring, so the result is the derivative of the energies of the steps that
    read it (and of whatever they produce from it in turn), while the
    producer's own energy and its internal dependencies (a charge model's
    self-energy, its total-charge correction) are held fixed: the
    electronegativity a charge-equilibration scheme wants, with any charge
    constraint left to the caller. A field that no step reads gets zeros.
    Under domain decomposition a ghost row's contribution goes home to its
    owner through the backward of the refresh, so the result is exact. A
    direct group that reads a requested field is evaluated by autograd for
    that call (its forces are equal to rounding). Requesting a field that
    neither the system carries nor a step produces, an integer field, or a
    name that is both read from the system and produced by a step (or
    produced by several steps), raises ``ValueError`` (under ranks, the
    ``DistributedError`` naming the ranks that every rank raises) before the
    evaluation moves any data. With ``field_gradients=None`` (default)
    nothing changes.
    """

    def __init__(self, groups, config: DomainConfig | None = None) -> None:
        super().__init__()
        if config is not None and not isinstance(config, DomainConfig):
            raise TypeError(f"Pipeline: config must be a DomainConfig, got {type(config).__name__}")
        self.groups = _as_groups(groups)
        _check_wiring(self.groups)
        self.names = _unique_names(self.groups)
        self.models = torch.nn.ModuleList([s.model for g in self.groups for s in g.steps])
        self.config = config if config is not None else DomainConfig()
        self._domain: LocalDomain | None = None
        self._pair_cache: dict = {}

    @property
    def halo(self) -> float:
        """The widest halo any model needs."""
        return max(s.model.halo for g in self.groups for s in g.steps)

    @property
    def cutoff(self) -> float:
        return max(s.model.cutoff for g in self.groups for s in g.steps)

    def halo_of(self, model: Model) -> float:
        """The ghost width ``model``'s view uses: its own halo, or the widest with ``config.halo == "max"``."""
        return self.halo if self.config.halo == "max" else model.halo

    def required_fields(self) -> set[str]:
        """Input fields that no earlier step produces: the system must carry them."""
        need, made = set(), set()
        for group in self.groups:
            for step in group.steps:
                need |= {step.source_of(i) for i in step.model.inputs} - made
                made |= set(step.produced().values())
        return need

    def missing_fields(self, system_fields) -> str | None:
        """The complaint about input fields the system lacks, if any."""
        missing = sorted(self.required_fields() - set(system_fields))
        if missing:
            return f"the system lacks field(s) {missing} that no step produces; add them to System.fields or wire a model producing them"
        return None

    def field_gradient_problem(self, names, system_fields: dict[str, torch.Tensor]) -> str | None:
        """The complaint about requested field gradients ``names`` that cannot be given, if any.

        Each name must be a floating-point field of the system (``system_fields``)
        or produced by exactly one step, and not both read from the system and
        produced (the two would be different variables under one name).
        """
        producers: dict[str, list[str]] = {}
        from_system: dict[str, list[str]] = {}
        made: set[str] = set()
        for row, group in zip(self.names, self.groups):
            for label, step in zip(row, group.steps):
                for inp in sorted(step.model.inputs):
                    if step.source_of(inp) not in made:
                        from_system.setdefault(step.source_of(inp), []).append(label)
                for visible in step.produced().values():
                    producers.setdefault(visible, []).append(label)
                    made.add(visible)
        available = sorted(set(system_fields) | set(producers))
        unknown = [name for name in names if name not in available]
        if unknown:
            return f"field_gradients: unknown field(s) {unknown}; available fields (the system's and those steps produce): {available}"
        for name in names:
            if len(producers.get(name, ())) > 1:
                return f"field_gradients: '{name}' is produced by several steps {producers[name]}; rename them apart with wire={{...}}"
            if name in producers and name in from_system:
                return (
                    f"field_gradients: '{name}' is both read from the system (by {from_system[name]}) "
                    f"and produced by {producers[name][0]}; rename the produced field with wire={{...}} and bind={{...}}"
                )
            if name not in producers and not system_fields[name].is_floating_point():
                return f"field_gradients: the system's field '{name}' has dtype {system_fields[name].dtype}, not a floating-point type"
        return None

    def forward(
        self, system: System | Domain | None, stress: bool = False, decompose: bool = True, energy: bool = True, field_gradients=None
    ) -> dict:
        """Evaluate ``system`` (see the class docstring); ``decompose=False`` keeps a System on this process.

        Every rank of a running process group must make the call unless
        ``decompose=False`` (a single-process reference on rank 0, say).
        ``field_gradients``: names of per-atom fields (a list, or one name)
        whose energy gradients ``d_energy_d_<name>`` to return.
        """
        wanted = _field_names(field_gradients)
        if isinstance(system, Domain):
            return self._evaluate_on(system, stress, energy, wanted)
        domain = _decomposition(system, self.config) if decompose and _decomposition is not None else None
        if domain is not None:
            return _gathered(self._evaluate_on(domain, stress, energy, wanted), domain)
        if not isinstance(system, System):
            raise TypeError(f"Pipeline: expected a halopipe.System or a Domain, got {type(system).__name__}")
        return self._evaluate_on(self._local_domain(system), stress, energy, wanted)

    def _local_domain(self, system: System) -> LocalDomain:
        if self._domain is not None and self._domain.compatible(system) and self._domain.skin == float(self.config.skin):
            self._domain.update(system)
        else:
            system.check_close_contacts()  # once per new system, not at every step
            self._domain = LocalDomain(system, skin=self.config.skin)
            self._pair_cache = {}
        return self._domain

    def _evaluate_on(self, domain: Domain, stress: bool, energy: bool, wanted: tuple[str, ...] = ()) -> dict:
        problem = domain.problem(self.config) or self.missing_fields(domain.fields)
        if wanted and not problem:
            problem = self.field_gradient_problem(wanted, domain.fields)
        problem = f"Pipeline: {problem}" if problem else None
        with domain.guard("pipeline evaluation"):
            out = evaluate(
                self,
                domain,
                stress=stress,
                pair_cache=self._pair_cache,
                halo_of=self.halo_of,
                problem=problem,
                energy=energy,
                field_gradients=wanted,
            )
        names = [name for row in self.names for name in row]
        out["halo"] = {name: domain.ghost_count(self.halo_of(s.model)) for name, s in zip(names, self._steps())}
        out["halo"]["exchanged"] = domain.n_exchanged
        return out

    def _steps(self) -> list[Step]:
        return [s for g in self.groups for s in g.steps]


def _field_names(field_gradients) -> tuple[str, ...]:
    """``field_gradients`` as a tuple of distinct names, in order (one name may be given bare)."""
    if field_gradients is None:
        return ()
    if isinstance(field_gradients, str):
        return (field_gradients,)
    return tuple(dict.fromkeys(field_gradients))


def gradient_key(name: str) -> str:
    """The result key of the energy's gradient with respect to field ``name``: ``d_energy_d_<name>``."""
    return f"d_energy_d_{name}"


def _gathered(out: dict, domain: Domain) -> dict:
    """Per-atom results of the owned atoms -> all atoms in the original order, on every rank."""
    out["forces"] = domain.gather(out["forces"])
    for key in [k for k in out if k.startswith("d_energy_d_")]:
        out[key] = domain.gather(out[key])
    if "energies" in out:
        out["energies"] = domain.gather(out["energies"])
    out["fields"] = {name: domain.gather(value) for name, value in out["fields"].items()}
    return out


# --------------------------------------------------------------------------- views
def build_view(
    domain: Domain,
    step: Step,
    width: float,
    positions: torch.Tensor,
    cell: torch.Tensor,
    fields: dict[str, torch.Tensor],
    pair_cache: dict,
    ghost_positions: torch.Tensor | None = None,
    need_energy: bool = True,
    need_virial: bool = True,
) -> LocalView:
    """The local view of ``step.model``: owned rows, ghosts within ``width``, pairs and inputs.

    ``ghost_positions`` are the owners' positions of at least the ghost rows
    within ``width`` (the prefix is taken), fetched once per evaluation; the
    view reuses them instead of exchanging positions again. For forces by
    autograd they must be the differentiable refresh of ``positions``
    (:func:`_group_ghost_positions`), so ghost gradients go home.
    ``need_energy`` and ``need_virial`` tell a direct evaluation what its
    caller uses (:class:`~halopipe.models.LocalView`).
    """
    model = step.model
    n = domain.n_owned
    n_ghost = domain.ghost_count(width)
    owned_offset, ghost_offset = domain.row_offsets(cell, n_ghost)
    ghosts = domain.ghost_rows(positions, width) if ghost_positions is None else ghost_positions[:n_ghost]
    rows = torch.cat([positions + owned_offset, ghosts + ghost_offset])

    def refresh(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, domain.ghost_rows(x, width)])

    half = bool(getattr(model, "half_list", False))
    candidates, offsets = _candidates(domain, rows.detach(), n_ghost, float(model.cutoff), half, pair_cache)
    if half:
        pairs, vec, dist = candidates, None, None  # the kernel masks by its cutoff itself: no per-step compaction
    else:
        vec, dist = pair_vectors(rows, candidates)
        keep = dist.detach() <= model.cutoff
        pairs, vec, dist = candidates[:, keep], vec[keep], dist[keep]
    inputs = {name: refresh(fields[step.source_of(name)]) for name in sorted(model.inputs)}
    return LocalView(
        positions=rows,
        numbers=torch.cat([domain.numbers, domain.ghost_numbers[:n_ghost]]),
        n_owned=n,
        cell=cell,
        pbc=domain.pbc,
        pairs=pairs,
        vectors=vec,
        distances=dist,
        fields=inputs,
        refresh=refresh,
        global_sum=domain.global_sum,
        n_total=domain.n_total,
        ids=torch.cat([domain.ids, domain.ghost_ids[:n_ghost]]),
        cutoff=float(model.cutoff),
        half_list=vec is None,
        mesh_transform=domain.mesh_transform,
        pair_offsets=offsets if half else None,  # a full list was compacted above: offsets no longer hold
        need_energy=need_energy,
        need_virial=need_virial,
    )


def _candidates(
    domain: Domain, rows: torch.Tensor, n_ghost: int, cutoff: float, half: bool, pair_cache: dict
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Candidate pairs within ``cutoff + skin`` among ``rows`` (owned, then ``n_ghost`` ghosts), once per plan, and their offsets.

    One search per plan and distinct (rows, cutoff, kind): models with equal
    cutoffs and widths share it. A half list is filtered from a wider cached
    one of the same plan when there is one (ghost rows are sorted by
    distance, so a narrower view's rows are a prefix of a wider view's;
    :func:`~halopipe.neighbors.narrower_half_pairs`). The cache holds
    ``(pairs, start)``: the offsets of lists grouped by owned row (else
    None), which the filter uses. Lists of older plans are dropped.
    """
    if cutoff <= 0.0:  # a model that pairs nothing (D3's lattice sums): no search
        return torch.zeros(2, 0, dtype=torch.int64, device=rows.device), None
    version = domain.plan_version
    for old in [k for k in pair_cache if k[1] != version]:
        del pair_cache[old]
    key = ((n_ghost, cutoff, half), version)
    cached = pair_cache.get(key)
    if cached is not None:
        return cached
    reach = cutoff + domain.skin
    wider = [c for (k, _), c in pair_cache.items() if half and k[2] and k[0] >= n_ghost and k[1] >= cutoff]
    if wider:
        pairs, start = min(wider, key=lambda c: c[0].shape[1])
        found = narrower_half_pairs(pairs, start, rows, reach)
    elif half:
        found = grouped_owned_half_pairs(rows, domain.n_owned, reach)
    else:
        found = (owned_pairs(rows, domain.n_owned, reach), None)
    pair_cache[key] = found
    return found


# ---------------------------------------------------------------------- evaluation
def _volume(cell: torch.Tensor) -> float:
    v = float(torch.linalg.det(cell.detach().to(torch.float64)).abs())
    if v < 1e-12:
        raise ValueError("stress requested but the cell has zero volume; stress needs a cell spanning three dimensions")
    return v


def evaluate(
    pipeline: Pipeline,
    domain: Domain,
    stress: bool = False,
    pair_cache: dict | None = None,
    halo_of=None,
    problem: str | None = None,
    energy: bool = True,
    field_gradients: tuple[str, ...] = (),
) -> dict:
    """Energy, forces (owned rows) and optionally stress of ``pipeline`` on ``domain``.

    ``halo_of(model)`` gives the ghost width each model's view uses (default:
    the model's own ``halo``; the widest halo for LAMMPS-like comparison).
    ``problem``: this rank's reason not to run (or None), raised on every rank
    before any data moves (agreed in the plan check's reduction).
    Returns ``energy``, ``energies`` (owned atoms), ``model_energies``,
    ``forces`` (owned atoms), ``fields`` and, with ``stress``, ``virial`` and ``stress``;
    ``energy=False`` leaves the three energy keys out (forces only).
    ``field_gradients``: names of fields (checked by
    :meth:`Pipeline.field_gradient_problem`) whose ``d_energy_d_<name>``
    (owned atoms) to add, as :class:`Pipeline` describes.
    """
    pair_cache = {} if pair_cache is None else pair_cache
    halo_of = halo_of or (lambda model: model.halo)
    if stress:
        volume = _volume(domain.cell)
    domain.prepare(pipeline.halo, problem)
    n, dtype, device = domain.n_owned, domain.positions.dtype, domain.positions.device
    forces = torch.zeros(n, 3, dtype=dtype, device=device)
    energies = torch.zeros(n, dtype=dtype, device=device) if energy else None
    virial = torch.zeros(3, 3, dtype=dtype, device=device)
    local_energy: list[torch.Tensor] = []
    produced: dict[str, torch.Tensor] = {}
    static = dict(domain.fields)
    # One exchange of positions per evaluation, at the widest width any view uses; every view takes its prefix.
    widest = max(halo_of(s.model) for grp in pipeline.groups for s in grp.steps)
    ghost_positions = domain.ghost_rows(domain.positions.detach(), widest)
    _search_widest_half_list(pipeline, domain, ghost_positions, pair_cache, halo_of)
    broken: list[torch.Tensor] = []  # per group: does it have a non-finite force or virial on this rank
    from_system = set()  # requested fields read from the system (the rest are produced): checked by field_gradient_problem
    if field_gradients:
        from_system = set(field_gradients) - {v for grp in pipeline.groups for s in grp.steps for v in s.produced().values()}
    gradients: dict[str, torch.Tensor] = {name: torch.zeros_like(static[name]) for name in from_system}
    for group in pipeline.groups:
        reads = {s.source_of(i) for s in group.steps for i in s.model.inputs} if from_system else set()
        if group.autograd or reads & from_system:  # a direct group gives no dE/dx: autograd for this call
            args = (group, domain, static, stress, pair_cache, halo_of, ghost_positions, energy)
            f, w, e, p, g = _run_autograd_group(*args, field_gradients)
            for name, grad in g.items():
                gradients[name] = gradients[name] + grad if name in gradients else grad
        else:
            f, w, e, p = _run_direct_group(group, domain, static, stress, pair_cache, halo_of, ghost_positions, energy)
        forces += f
        virial += w
        for per_atom in e if energy else ():
            energies += per_atom
            local_energy.append(per_atom.sum())
        produced.update(p)
        broken.append((~torch.isfinite(f.sum() + w.sum())).to(dtype))  # a NaN or inf anywhere makes the sum non-finite
    # One reduction for energies, flags and the virial: every rank sees the same values and raises the same error.
    k = len(local_energy)
    parts = [torch.stack(local_energy).detach()] if energy else []
    parts += [torch.stack(broken)] + ([virial.reshape(9)] if stress else [])
    reduced = domain.all_reduce(torch.cat(parts))
    totals = reduced[:k]
    _raise_if_not_finite(pipeline, totals, reduced[k : k + len(broken)])
    result = {"forces": forces, "fields": produced}
    result.update({gradient_key(name): gradients[name] for name in field_gradients})
    if energy:
        names = [name for row in pipeline.names for name in row]
        result.update(energy=totals.sum(), energies=energies, model_energies={name: totals[k] for k, name in enumerate(names)})
    if stress:
        result["virial"] = reduced[k + len(broken) :].reshape(3, 3)
        result["stress"] = -result["virial"] / volume
    return result


def _search_widest_half_list(pipeline: Pipeline, domain: Domain, ghost_positions: torch.Tensor, pair_cache: dict, halo_of) -> None:
    """With several half-list models of different widths or cutoffs, search once at the widest of both (per plan).

    The others then filter their lists from it (:func:`_candidates`) instead of searching again.
    """
    needs = {(domain.ghost_count(halo_of(s.model)), float(s.model.cutoff)) for g in pipeline.groups for s in g.steps if s.model.half_list}
    if len(needs) < 2:
        return
    n_ghost, cutoff = max(n for n, _ in needs), max(c for _, c in needs)
    if ((n_ghost, cutoff, True), domain.plan_version) in pair_cache:
        return
    owned_offset, ghost_offset = domain.row_offsets(domain.cell.detach(), n_ghost)
    rows = torch.cat([domain.positions.detach() + owned_offset, ghost_positions[:n_ghost] + ghost_offset])
    _candidates(domain, rows, n_ghost, cutoff, True, pair_cache)


def _raise_if_not_finite(pipeline: Pipeline, totals: torch.Tensor, broken_groups: torch.Tensor) -> None:
    """:class:`~halopipe.models.NonFiniteError` naming the model whose energy, or the group whose forces, is not finite."""
    hint = "check the structure for atoms too close together and the model's parameters"
    names = [(name, step.model.name) for row, group in zip(pipeline.names, pipeline.groups) for name, step in zip(row, group.steps)]
    for (name, model), value in zip(names, totals.tolist()):
        if not math.isfinite(value):
            label = model if name == model else f"{name} ({model})"
            raise NonFiniteError(f"{label} returned a non-finite energy ({value}); {hint}", model)
    for row, group, flag in zip(pipeline.names, pipeline.groups, broken_groups.tolist()):
        if flag != 0:
            models = ", ".join(row)
            culprit = group.steps[0].model.name if len(row) == 1 else models
            raise NonFiniteError(f"non-finite forces or virial from {models}; {hint}", culprit)


def _group_ghost_positions(group: Group, domain: Domain, positions: torch.Tensor, halo_of, ghost_positions: torch.Tensor) -> torch.Tensor:
    """The ghost rows' owner positions at the group's widest width, as one differentiable refresh of ``positions``.

    Every view of the group takes its prefix, so the backward pass sends the
    ghost gradients of all the group's models home in one exchange.
    """
    width = max(halo_of(s.model) for s in group.steps)
    return domain.ghost_rows(positions, width, known=ghost_positions[: domain.ghost_count(width)])


def _run_autograd_group(
    group: Group, domain: Domain, static: dict, stress: bool, pair_cache: dict, halo_of, ghost_positions, energy: bool, wanted=()
):
    """Forces, virial, per-atom energies and produced fields of ``group``, and the gradients of the ``wanted`` fields it reads or produces.

    A wanted field of the system becomes a leaf the group's views refresh
    from (the refresh's backward sums ghost rows' gradients into owners); a
    wanted produced field gets a node of its own at the wiring point, so its
    gradient is what the consumers send back (:class:`Pipeline`).
    """
    pos = domain.positions.detach().requires_grad_(True)
    cell = domain.cell.detach()
    eps = torch.zeros(3, 3, dtype=pos.dtype, device=pos.device, requires_grad=stress)
    if stress:
        strain = torch.eye(3, dtype=pos.dtype, device=pos.device) + eps
        positions, cell = pos @ strain, cell @ strain
    else:
        positions = pos
    fields = dict(static)
    leaves: dict[str, torch.Tensor] = {}
    if wanted:
        reads = {s.source_of(i) for s in group.steps for i in s.model.inputs} - {v for s in group.steps for v in s.produced().values()}
        leaves = {name: fields[name].detach().requires_grad_(True) for name in wanted if name in reads and name in static}
        fields.update(leaves)
    made: dict[str, torch.Tensor] = {}
    energy = pos.sum() * 0.0  # keeps a graph on ranks that own no atom
    per_atom_energies = []
    ghosts = _group_ghost_positions(group, domain, positions, halo_of, ghost_positions)
    for step in group.steps:
        view = build_view(domain, step, halo_of(step.model), positions, cell, fields, pair_cache, ghosts)
        out = step.model(view)
        energy = energy + out.energies.sum()
        per_atom_energies.append(out.energies.detach())
        for out_name, visible in step.produced().items():
            value = out.fields[out_name]
            if visible in wanted:
                # A node of its own: the producer's energy used `value` before the wiring point and must not count,
                # and a producer whose field carries no graph still gets a leaf to differentiate.
                value = leaves[visible] = value.clone() if value.requires_grad else value.detach().requires_grad_(True)
            fields[visible] = value
            made[visible] = value.detach()
    wrt = [pos, eps] if stress else [pos]
    grads = torch.autograd.grad(energy, wrt + list(leaves.values()), allow_unused=True)
    forces = -grads[0] if grads[0] is not None else torch.zeros_like(pos)
    virial = torch.zeros(3, 3, dtype=pos.dtype, device=pos.device)
    if stress and grads[1] is not None:
        virial = -grads[1]
    field_grads = {
        name: (grad.detach() if grad is not None else torch.zeros_like(leaf.detach()))
        for (name, leaf), grad in zip(leaves.items(), grads[len(wrt) :])
    }
    return forces.detach(), virial.detach(), per_atom_energies, made, field_grads


def _check_direct_output(model, out, view: LocalView) -> None:
    """A direct-force model returned forces for every row (or only the owned ones, when ``ghost_forces`` is False).

    And the energies and virial its view needs.
    """
    n_owned, n_rows = view.n_owned, view.n_rows
    if out.forces is None:
        raise RuntimeError(f"{model.name}: asked for direct forces but returned none")
    for name, needed in (("energies", view.need_energy), ("virial", view.need_virial)):
        if needed and getattr(out, name) is None:
            raise RuntimeError(f"{model.name}: a direct evaluation that needs its {name} returned none")
    rows = n_rows if model.ghost_forces else n_owned
    if out.forces.shape[0] != rows:
        which = "every row of its view" if model.ghost_forces else "its owned rows only (ghost_forces is False)"
        raise RuntimeError(f"{model.name}: direct forces have {out.forces.shape[0]} rows, expected {rows}: {which}")


def _run_direct_group(group: Group, domain: Domain, static: dict, stress: bool, pair_cache: dict, halo_of, ghost_positions, energy: bool):
    n = domain.n_owned
    positions, cell = domain.positions.detach(), domain.cell.detach()
    forces = torch.zeros_like(positions)
    virial = torch.zeros(3, 3, dtype=positions.dtype, device=positions.device)
    per_atom_energies = []
    with torch.no_grad():
        for step in group.steps:
            width = halo_of(step.model)
            view = build_view(domain, step, width, positions, cell, static, pair_cache, ghost_positions, energy, stress)
            out = step.model(view, direct=True)
            _check_direct_output(step.model, out, view)
            forces += out.forces[:n]
            if step.model.ghost_forces:  # a class property, so every rank agrees whether this collective runs
                forces += domain.fold_ghosts(out.forces[n:], width)
            if stress:
                virial += out.virial
            per_atom_energies.append(out.energies)  # None where not needed; evaluate reads them only with energy
    return forces, virial, per_atom_energies, {}
