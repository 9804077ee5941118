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

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from .batch import Batch, BatchDomain, BatchPlacement
from .domain import Domain, DomainConfig, LocalDomain
from .models.base import LocalView, Model, ModelOutput, NonFiniteError
from .models.compile import compile_models
from .neighbors import pair_vectors
from .system import System

__all__ = ["Step", "Group", "Pipeline", "evaluate", "build_view", "register_decomposition", "RESERVED_NAMES"]

RESERVED_NAMES = frozenset({"energy", "energies", "model_energies", "forces", "stress", "virial", "fields", "halo"})
"""Keys of a pipeline result; no field may be named like one."""

Decomposition = Callable[[System | list | None, DomainConfig], Domain | BatchPlacement | None]
_decomposition: Decomposition | None = None


def register_decomposition(decompose: Decomposition | None) -> None:
    """Install how a :class:`~halopipe.System` or a batch is split over the ranks of a running process group.

    ``decompose(system_or_batch_or_None, config)`` is called collectively by
    every rank and returns the rank's :class:`~halopipe.domain.Domain` (for a
    system: rank 0's decides what the others passed) or
    :class:`~halopipe.batch.BatchPlacement` (for a batch), or ``None`` when no
    process group of more than one rank is running (then the pipeline runs on
    one process). ``halopipe.distributed`` registers its scatter on import,
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
    compile : compile the local stages of every model that has them (MACE,
        SevenNet, TorchModel: forces by autograd through a network) with
        ``torch.compile`` (:mod:`halopipe.models.compile`); a model built with
        ``compile=True`` keeps its own settings. :attr:`compilations` counts
        the graphs compiled so far.
    compile_kwargs : options of the compilation (``dynamic``, ``fullgraph``,
        ``mode``, ``options``); only with ``compile=True``.

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

    def __init__(self, groups, config: DomainConfig | None = None, *, compile: bool = False, compile_kwargs: dict | None = None) -> None:
        super().__init__()
        if config is not None and not isinstance(config, DomainConfig):
            raise TypeError(f"Pipeline: config must be a DomainConfig, got {type(config).__name__}")
        if compile_kwargs is not None and not compile:
            raise ValueError("Pipeline: compile_kwargs were given without compile=True; add compile=True or remove them")
        self.groups = _as_groups(groups)
        _check_wiring(self.groups)
        self.names = _unique_names(self.groups)
        self.models = torch.nn.ModuleList([s.model for g in self.groups for s in g.steps])
        if compile:
            compile_models(self.models, compile_kwargs)
        self.config = config if config is not None else DomainConfig()
        self._domain: LocalDomain | None = None

    @property
    def halo(self) -> float:
        """The widest halo any model needs."""
        return max(s.model.halo for g in self.groups for s in g.steps)

    @property
    def cutoff(self) -> float:
        return max(s.model.cutoff for g in self.groups for s in g.steps)

    @property
    def compilations(self) -> int:
        """Graphs compiled so far by the models' compiled stages (0 when nothing is compiled)."""
        return sum(m.stages.compilations for m in self.models if m.stages is not None)

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

    def device_problem(self, device: torch.device) -> str | None:
        """The complaint about model tensors on another device than the system's ``device``, if any."""
        for step in self._steps():
            for tensor in itertools.chain(step.model.parameters(), step.model.buffers()):
                other = tensor.device
                if other.type != device.type or (other.index is not None and device.index is not None and other.index != device.index):
                    return (
                        f"{step.model.name} holds tensors on {other} but the system is on {device}; "
                        f"move one to the other: pipeline.to({str(device)!r}) or system.to(device={str(other)!r})"
                    )
        return None

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
        placed = _decomposition(system, self.config) if decompose and _decomposition is not None else None
        if isinstance(placed, BatchPlacement):
            return _evaluate_placed(self, placed, stress, energy, wanted)
        if placed is not None:
            return _gathered(self._evaluate_on(placed, stress, energy, wanted), placed)
        if isinstance(system, (list, tuple, Batch)):
            return self._evaluate_on(self._batch_domain(Batch(system)), stress, energy, wanted)
        if not isinstance(system, System):
            raise TypeError(f"Pipeline: expected a halopipe.System or a Domain, got {type(system).__name__}")
        return self._evaluate_on(self._local_domain(system), stress, energy, wanted)

    def _local_domain(self, system: System) -> LocalDomain:
        kept = self._domain
        if kept is not None and not isinstance(kept, BatchDomain) and kept.compatible(system) and kept.skin == float(self.config.skin):
            self._domain.update(system)
        else:
            system.check_close_contacts()  # once per new system, not at every step
            self._domain = LocalDomain(system, skin=self.config.skin)
        return self._domain

    def _batch_domain(self, batch: Batch) -> BatchDomain:
        """The batch's domain, kept between calls on the same atoms (a relaxation, NEB) so plans are reused."""
        kept = self._domain
        if isinstance(kept, BatchDomain) and kept.compatible(batch) and kept.skin == float(self.config.skin):
            kept.update(batch)
            return kept
        for b, system in enumerate(batch.systems):
            try:
                system.check_close_contacts()
            except ValueError as exc:
                raise ValueError(f"system {batch.labels[b]} of the batch: {exc}") from exc
        self._domain = BatchDomain(batch, skin=self.config.skin)
        return self._domain

    def _evaluate_on(self, domain: Domain, stress: bool, energy: bool, wanted: tuple[str, ...] = ()) -> dict:
        problem = domain.problem(self.config) or self.device_problem(domain.positions.device) or self.missing_fields(domain.fields)
        if wanted and not problem:
            problem = self.field_gradient_problem(wanted, domain.fields)
        problem = f"Pipeline: {problem}" if problem else None
        with domain.guard("pipeline evaluation"):
            out = evaluate(
                self,
                domain,
                stress=stress,
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


def _evaluate_placed(pipeline: Pipeline, placement: BatchPlacement, stress: bool, energy: bool, wanted: tuple[str, ...]) -> dict:
    """A batch spread over ranks: each rank's whole systems as one local batch, then each split system decomposed.

    Every rank writes the rows of what it evaluated (a split system's on the
    root only: its results are already gathered on every rank) into full-size
    results, and one all-reduce completes them on every rank.
    """
    problem = pipeline.missing_fields(placement.fields)
    if wanted and not problem:
        problem = pipeline.field_gradient_problem(wanted, placement.fields)
    placement.agree(f"Pipeline: {problem}" if problem else None)
    starts = [sum(placement.sizes[:b]) for b in range(len(placement.sizes) + 1)]
    pieces: list[tuple[list[int], dict]] = []
    with placement.guard("batch evaluation"):
        if placement.whole_systems:
            local = BatchDomain(Batch(placement.whole_systems, labels=placement.whole), skin=pipeline.config.skin)
            pieces.append((placement.whole, pipeline._evaluate_on(local, stress, energy, wanted)))
    # A reduction that waits watching for a peer's failure: a rank whose local batch failed has reported it, and
    # every other rank raises that cause here instead of blocking in the object gather below until the timeout.
    placement.agree(None)
    for index, domain in placement.split:
        out = _gathered(pipeline._evaluate_on(domain, stress, energy, wanted), domain)
        if placement.is_root:  # every rank holds the gathered results; one adds them
            out.update({key: out[key].unsqueeze(0) for key in ("energy", "stress", "virial") if key in out})
            if "model_energies" in out:
                out["model_energies"] = {name: e.unsqueeze(0) for name, e in out["model_energies"].items()}
            pieces.append(([index], out))
    shapes = placement.share({name: tuple(v.shape[1:]) for _, out in pieces for name, v in out["fields"].items()})
    produced = {name: shape for one in shapes for name, shape in one.items()}
    return _assembled(pipeline, placement, pieces, starts, produced, stress, energy, wanted)


def _assembled(pipeline: Pipeline, placement: BatchPlacement, pieces, starts, produced: dict, stress: bool, energy: bool, wanted) -> dict:
    """Full-size batch results from each rank's ``pieces`` (system indices, their results), summed over ranks."""
    n_sys, n_atoms, dtype, device = len(placement.sizes), starts[-1], placement.dtype, placement.device
    per_system = {"energy": ()} if energy else {}
    per_system.update({"stress": (3, 3), "virial": (3, 3)} if stress else {})
    names = [name for row in pipeline.names for name in row] if energy else []
    per_atom = {"forces": (3,)} | ({"energies": ()} if energy else {})
    per_atom.update({gradient_key(name): tuple(placement.fields[name].shape[1:]) if name in placement.fields else () for name in wanted})
    result = {key: torch.zeros((n_sys,) + shape, dtype=dtype, device=device) for key, shape in per_system.items()}
    result.update({key: torch.zeros((n_atoms,) + shape, dtype=dtype, device=device) for key, shape in per_atom.items()})
    result["model_energies"] = {name: torch.zeros(n_sys, dtype=dtype, device=device) for name in names}
    result["fields"] = {name: torch.zeros((n_atoms,) + shape, dtype=dtype, device=device) for name, shape in produced.items()}
    for indices, out in pieces:
        local_starts = [0]
        for b in indices:
            local_starts.append(local_starts[-1] + placement.sizes[b])
        for j, b in enumerate(indices):
            rows, mine = slice(starts[b], starts[b + 1]), slice(local_starts[j], local_starts[j + 1])
            for key in per_system:
                result[key][b] = out[key][j]
            for key in per_atom:
                result[key][rows] = out[key][mine]
            for name in names:
                result["model_energies"][name][b] = out["model_energies"][name][j]
            for name, value in out["fields"].items():
                result["fields"][name][rows] = value[mine]
    flat = [result[k] for k in (*per_system, *per_atom)] + list(result["model_energies"].values()) + list(result["fields"].values())
    summed = placement.all_reduce(torch.cat([t.reshape(-1) for t in flat])) if flat else None
    offset = 0
    for t in flat:
        t.copy_(summed[offset : offset + t.numel()].reshape(t.shape))
        offset += t.numel()
    return result


# --------------------------------------------------------------------------- views
def build_view(
    domain: Domain,
    step: Step,
    width: float,
    positions: torch.Tensor,
    cell: torch.Tensor,
    fields: dict[str, torch.Tensor],
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
    ghosts = domain.ghost_rows(positions, width) if ghost_positions is None else ghost_positions[:n_ghost]
    rows = domain.placed_rows(positions, ghosts, cell)

    def refresh(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, domain.ghost_rows(x, width)])

    half = bool(getattr(model, "half_list", False))
    detached, cutoff = rows.detach(), float(model.cutoff)
    if half:  # made on first read: a model that evaluates the one-holder list never makes the whole half list
        pairs, vec, dist = (lambda: domain.candidate_pairs(detached, n_ghost, cutoff, "half")), None, None
    else:
        candidates = domain.candidate_pairs(detached, n_ghost, cutoff, "directed")
        vec, dist = pair_vectors(rows, candidates)
        keep = dist.detach() <= model.cutoff
        pairs, vec, dist = candidates[:, keep], vec[keep], dist[keep]
    inputs = {name: refresh(fields[step.source_of(name)]) for name in sorted(model.inputs)}
    numbers, ids = domain.row_labels(n_ghost)
    return LocalView(
        positions=rows,
        numbers=numbers,
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
        ids=ids,
        cutoff=float(model.cutoff),
        half_list=half,
        mesh_transform=domain.mesh_transform,
        need_energy=need_energy,
        need_virial=need_virial,
        system=domain.row_systems(n_ghost) if domain.system is not None else None,
        system_sizes=domain.system_sizes,
        fold=lambda x_ghost: domain.fold_ghosts(x_ghost, width),
        one_holder=(lambda: domain.candidate_pairs(detached, n_ghost, cutoff, "one_holder")) if half else None,
    )


def _pair_list_need(domain: Domain, model, halo_of) -> tuple[int, float, str]:
    """``(n_ghost, cutoff, kind)`` of the list a half-list model's view will read (:meth:`Domain.search_widest_lists`)."""
    kind = "one_holder" if model.one_holder_list else "half"
    return domain.ghost_count(halo_of(model)), float(model.cutoff), kind


# ---------------------------------------------------------------------- evaluation
def _volume(cell: torch.Tensor, domain: Domain) -> torch.Tensor:
    """The cell's volume (one per system for a batch's ``(B, 3, 3)`` cells); an error for a flat cell."""
    v = torch.linalg.det(cell.detach().to(torch.float64)).abs()
    flat = (v < 1e-12).reshape(-1).nonzero()
    if flat.numel():
        which = "the cell has" if cell.ndim == 2 else f"{domain.label(int(flat[0]))} has a cell with"
        raise ValueError(f"stress requested but {which} zero volume; stress needs a cell spanning three dimensions")
    return v.to(cell.dtype)


def evaluate(
    pipeline: Pipeline,
    domain: Domain,
    stress: bool = False,
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
    halo_of = halo_of or (lambda model: model.halo)
    if stress:
        volume = _volume(domain.cell, domain)
    widths = {halo_of(s.model) for grp in pipeline.groups for s in grp.steps}
    domain.prepare(widths, problem)  # a band of ghost rows per width: each view takes its prefix
    n, dtype, device = domain.n_owned, domain.positions.dtype, domain.positions.device
    batched = domain.system is not None  # a batch of systems (halopipe.batch): energies and virial per system
    forces = None  # the first group's forces, then sums (no zeroed array, no copy for one group)
    energies = torch.zeros(n, dtype=dtype, device=device) if energy else None
    virial = torch.zeros(domain.cell.shape, dtype=dtype, device=device)
    local_energy: list[torch.Tensor] = []
    produced: dict[str, torch.Tensor] = {}
    static = dict(domain.fields)
    # One exchange of positions per evaluation, at the widest width any view uses; every view takes its prefix.
    ghost_positions = domain.ghost_rows(domain.positions.detach(), max(widths))
    steps = [s for g in pipeline.groups for s in g.steps]
    domain.search_widest_lists({_pair_list_need(domain, s.model, halo_of) for s in steps if s.model.half_list}, ghost_positions)
    broken: list[torch.Tensor] = []  # per group: does it have a non-finite force or virial on this rank
    from_system = set()  # requested fields read from the system (the rest are produced): checked by field_gradient_problem
    if field_gradients:
        from_system = set(field_gradients) - {v for grp in pipeline.groups for s in grp.steps for v in s.produced().values()}
    gradients: dict[str, torch.Tensor] = {name: torch.zeros_like(static[name]) for name in from_system}
    for group in pipeline.groups:
        reads = {s.source_of(i) for s in group.steps for i in s.model.inputs} if from_system else set()
        # A direct group gives no dE/dx, nor a virial per system of a batch: autograd for this call.
        if group.autograd or reads & from_system or (batched and stress):
            args = (group, domain, static, stress, halo_of, ghost_positions, energy)
            f, w, e, p, g = _run_autograd_group(*args, field_gradients)
            for name, grad in g.items():
                gradients[name] = gradients[name] + grad if name in gradients else grad
        else:
            f, w, e, p = _run_direct_group(group, domain, static, stress, halo_of, ghost_positions, energy)
        forces = f if forces is None else forces + f
        virial += w
        for per_atom in e if energy else ():
            energies += per_atom
            local_energy.append(per_atom.new_zeros(domain.n_systems).index_add(0, domain.system, per_atom) if batched else per_atom.sum())
        produced.update(p)
        broken.append((~torch.isfinite(f.sum() + w.sum())).to(dtype))  # a NaN or inf anywhere makes the sum non-finite
    if not energy and not stress:
        # Forces only (the MD steps between reports): nothing to add up across ranks, so no reduction, one
        # synchronisation a step fewer. A rank whose forces or virial are not finite raises here; the guard around
        # the evaluation reports it, and the other ranks raise it at their next communication (the next step's
        # rebuild check), as for any failure on one rank.
        _raise_if_not_finite(pipeline, None, torch.stack(broken), domain)
        return {"forces": forces, "fields": produced} | {gradient_key(name): gradients[name] for name in field_gradients}
    # One reduction for energies, flags and the virial: every rank sees the same values and raises the same error.
    k = len(local_energy)
    parts = [torch.stack(local_energy).detach()] if energy else []
    parts += [torch.stack(broken)] + ([virial.reshape(-1)] if stress else [])
    reduced = domain.all_reduce(torch.cat([part.reshape(-1) for part in parts]))
    b = domain.n_systems if batched else 1
    totals = reduced[: k * b].reshape((k, b) if batched else (k,))
    _raise_if_not_finite(pipeline, totals, reduced[k * b : k * b + len(broken)], domain)
    result = {"forces": forces, "fields": produced}
    result.update({gradient_key(name): gradients[name] for name in field_gradients})
    if energy:
        names = [name for row in pipeline.names for name in row]
        result.update(energy=totals.sum(0), energies=energies, model_energies={name: totals[k] for k, name in enumerate(names)})
    if stress:
        result["virial"] = reduced[k * b + len(broken) :].reshape(virial.shape)
        result["stress"] = -result["virial"] / (volume[:, None, None] if batched else volume)
    return result


def _raise_if_not_finite(pipeline: Pipeline, totals: torch.Tensor | None, broken_groups: torch.Tensor, domain: Domain) -> None:
    """:class:`~halopipe.models.NonFiniteError` naming the model whose energy, or the group whose forces, is not finite.

    ``totals``: each model's energy (per system of a batch), or None where no energy was asked for.
    """
    hint = "check the structure for atoms too close together and the model's parameters"
    names = [(name, step.model.name) for row, group in zip(pipeline.names, pipeline.groups) for name, step in zip(row, group.steps)]
    for (name, model), values in zip(names, [] if totals is None else totals.reshape(len(names), -1).tolist()):
        bad = [b for b, value in enumerate(values) if not math.isfinite(value)]
        if bad:
            label = model if name == model else f"{name} ({model})"
            where = f" for {domain.label(bad[0])}" if totals.ndim == 2 else ""
            raise NonFiniteError(f"{label} returned a non-finite energy ({values[bad[0]]}){where}; {hint}", model)
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


def _run_autograd_group(group: Group, domain: Domain, static: dict, stress: bool, halo_of, ghost_positions, energy: bool, wanted=()):
    """Forces, virial, per-atom energies (None without ``energy``), produced fields and ``wanted`` fields' gradients of ``group``.

    ``wanted``: fields the group reads or produces. A wanted field of the
    system becomes a leaf the group's views refresh from (the refresh's
    backward sums ghost rows' gradients into owners); a wanted produced field
    gets a node of its own at the wiring point, so its gradient is what the
    consumers send back (:class:`Pipeline`). A model's
    energies on its ghost rows (shares of their owners) count in the energy
    where they lie, so the graph holds no fold and its backward no refresh;
    they go home, outside the graph, only for reported per-atom energies
    (:func:`_owned_energies`).
    """
    pos = domain.positions.detach().requires_grad_(True)
    cell = domain.cell.detach()
    eps = torch.zeros(cell.shape, dtype=pos.dtype, device=pos.device, requires_grad=stress)  # one strain per system of a batch
    if stress:
        strain = torch.eye(3, dtype=pos.dtype, device=pos.device) + eps
        positions = domain.strained(pos, strain) if domain.system is not None else pos @ strain
        cell = cell @ strain
    else:
        positions = pos
    fields = dict(static)
    leaves: dict[str, torch.Tensor] = {}
    if wanted:
        reads = {s.source_of(i) for s in group.steps for i in s.model.inputs} - {v for s in group.steps for v in s.produced().values()}
        leaves = {name: fields[name].detach().requires_grad_(True) for name in wanted if name in reads and name in static}
        fields.update(leaves)
    made: dict[str, torch.Tensor] = {}
    total = pos.sum() * 0.0  # keeps a graph on ranks that own no atom
    per_atom_energies = []
    ghosts = _group_ghost_positions(group, domain, positions, halo_of, ghost_positions)
    for step in group.steps:
        width = halo_of(step.model)
        out = _run_step(domain, step, width, positions, cell, fields, ghosts)
        total = total + out.energies.sum()  # every row's share, ghost rows' included: each counted once over all ranks
        per_atom_energies.append(_owned_energies(domain, out.energies, width) if energy else None)
        for out_name, visible in step.produced().items():
            value = out.fields[out_name]
            if visible in wanted:
                # A node of its own: the producer's energy used `value` before the wiring point and must not count,
                # and a producer whose field carries no graph still gets a leaf to differentiate.
                value = leaves[visible] = value.clone() if value.requires_grad else value.detach().requires_grad_(True)
            fields[visible] = value
            made[visible] = value.detach()
    wrt = [pos, eps] if stress else [pos]
    grads = torch.autograd.grad(total, wrt + list(leaves.values()), allow_unused=True)
    forces = -grads[0] if grads[0] is not None else torch.zeros_like(pos)
    virial = torch.zeros(cell.shape, dtype=pos.dtype, device=pos.device)
    if stress and grads[1] is not None:
        virial = -grads[1]
    field_grads = {
        name: (grad.detach() if grad is not None else torch.zeros_like(leaf.detach()))
        for (name, leaf), grad in zip(leaves.items(), grads[len(wrt) :])
    }
    return forces.detach(), virial.detach(), per_atom_energies, made, field_grads


def _owned_energies(domain: Domain, energies: torch.Tensor, width: float) -> torch.Tensor:
    """Per-atom energies of the owned rows from a model's ``energies`` (owned rows, or every row of its view), outside the graph.

    The ghost rows' shares go home by one fold, which runs on every rank
    alike whatever the local shapes (zeros where the model returned owned
    rows only): it is a collective.
    """
    n = domain.n_owned
    energies = energies.detach()
    ghost = energies[n:] if energies.shape[0] > n else energies.new_zeros(domain.ghost_count(width))
    with torch.no_grad():
        return energies[:n] + domain.fold_ghosts(ghost, width)


def _check_energy_rows(model, out: ModelOutput, view: LocalView, direct: bool) -> None:
    """Energies come one per owned row, or (through autograd only) one per row of the view (:class:`~halopipe.models.ModelOutput`)."""
    if out.energies is None:
        return
    allowed = {view.n_owned} if direct else {view.n_owned, view.n_rows}
    if out.energies.ndim != 1 or int(out.energies.shape[0]) not in allowed:
        what = "its owned rows or all its rows"
        if direct:
            what = "its owned rows (a direct evaluation folds its ghost rows' shares home itself)"
        shape = tuple(out.energies.shape)
        raise RuntimeError(f"{model.name}: energies of shape {shape}, expected one per row of {what}: {sorted(allowed)}")


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


def _run_direct_group(group: Group, domain: Domain, static: dict, stress: bool, halo_of, ghost_positions, energy: bool):
    positions, cell = domain.positions.detach(), domain.cell.detach()
    forces = None  # the first step's own forces, then sums: no zeroed array and no copy for a group of one
    virial = torch.zeros(3, 3, dtype=positions.dtype, device=positions.device)
    per_atom_energies = []
    with torch.no_grad():
        for step in group.steps:
            out = _run_step(domain, step, halo_of(step.model), positions, cell, static, ghost_positions, True, energy, stress)
            forces = out.forces if forces is None else forces + out.forces
            if stress:
                virial += out.virial
            per_atom_energies.append(out.energies)  # None where not needed; evaluate reads them only with energy
    return forces, virial, per_atom_energies, {}


def _run_step(
    domain: Domain,
    step: Step,
    width: float,
    positions: torch.Tensor,
    cell: torch.Tensor,
    fields: dict,
    ghost_positions: torch.Tensor | None,
    direct: bool = False,
    need_energy: bool = True,
    need_virial: bool = True,
) -> ModelOutput:
    """``step.model`` on its view of ``domain``; direct forces come back complete on the owned rows (ghost rows folded home).

    On a batch, a model that is not ``batchable`` sees one view per system
    (:func:`_run_per_system`), and a model's ``ValueError`` names the system
    that caused it.
    """
    if domain.system is not None and not step.model.batchable:
        return _run_per_system(domain, step, width, positions, cell, fields, direct, need_energy, need_virial)
    view = build_view(domain, step, width, positions, cell, fields, ghost_positions, need_energy, need_virial)
    try:
        out = step.model(view, direct=direct)
    except ValueError as exc:
        if domain.system is not None:
            _raise_naming_system(exc, domain, step, width, positions, cell, fields)
        raise
    _check_energy_rows(step.model, out, view, direct)
    if direct:
        _check_direct_output(step.model, out, view)
        n = domain.n_owned
        forces = out.forces[:n]
        if step.model.ghost_forces:  # a class property, so every rank agrees whether this collective runs
            forces = forces + domain.fold_ghosts(out.forces[n:], width)
        out = replace(out, forces=forces)
    return out


def _run_per_system(domain, step: Step, width: float, positions, cell, fields: dict, direct: bool, need_energy: bool, need_virial: bool):
    """``step.model`` on each system of a batch apart, through the systems' own domains: outputs concatenated (virials stacked)."""
    outs = []
    for b, part in enumerate(domain.parts):
        rows = domain.part_rows(b)
        own = {name: value[rows] for name, value in fields.items()}
        try:
            outs.append(_run_step(part, step, width, positions[rows], cell[b], own, None, direct, need_energy, need_virial))
        except ValueError as exc:
            raise ValueError(f"{domain.label(b)}: {exc}") from exc
    for out, part in zip(outs, domain.parts):
        n = part.n_owned
        if out.energies is not None and out.energies.shape[0] > n:  # ghost rows' shares home within their system: one process
            out.energies = out.energies[:n] + part.fold_ghosts(out.energies[n:], width)
    energies = None if any(o.energies is None for o in outs) else torch.cat([o.energies for o in outs])
    made = {name: torch.cat([o.fields[name] for o in outs]) for name in (outs[0].fields if outs else {})}
    out = ModelOutput(energies=energies, fields=made)
    if direct:
        out.forces = torch.cat([o.forces for o in outs])
        out.virial = None if any(o.virial is None for o in outs) else torch.stack([o.virial for o in outs])
    return out


def _raise_naming_system(error: ValueError, domain, step: Step, width: float, positions, cell, fields: dict) -> None:
    """Re-raise a batchable model's ``error`` on a whole batch naming the first system that raises it alone (if one does)."""
    with torch.no_grad():
        _run_per_system(
            domain, step, width, positions.detach(), cell.detach(), {k: v.detach() for k, v in fields.items()}, False, True, False
        )
    raise error
