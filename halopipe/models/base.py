"""The model contract: what every interatomic model sees and returns.

A model never sees ranks. It receives a :class:`LocalView`: owned atoms first,
then ghost images within the model's own halo, a neighbour list whose centres
are owned, per-atom input fields on every row, and two differentiable helpers:

* ``refresh(x_owned) -> x_rows`` fills the ghost rows of a per-atom tensor
  from their owners (on one process: from the periodic originals; under domain
  decomposition: through a halo exchange whose backward sends ghost gradients
  home);
* ``global_sum(x)`` sums over all ranks (identity on one process);
* ``fold(x_ghost) -> x_owned`` sums per-row values of the ghost rows into
  their owners (refresh's adjoint, differentiable), for a pair model over
  :attr:`LocalView.one_holder_pairs`, where each pair of the system is
  evaluated by one holder only and the ghost ends' shares go home.

It returns a :class:`ModelOutput`: per-atom energies of the owned rows (their
sum is this view's share of the total energy), any produced per-atom fields for
the owned rows, and, when asked for direct forces, forces on every row of the
view plus this view's virial share. With these rules one backward pass through
all ranks yields exact forces and stress for any composition of models.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.pairs import HalfList, HalfListCache
from ..neighbors import GroupedPairs
from .compile import CompiledStages

__all__ = [
    "LocalView",
    "ModelOutput",
    "Model",
    "NonFiniteError",
    "check_positive_length",
    "virial_from_forces",
    "direct_by_local_autograd",
    "fold_ghost_shares",
    "pair_energies_once",
    "add_to_owned",
]


class NonFiniteError(ValueError):
    """A model produced a non-finite energy, force or virial (``nan`` or ``inf``).

    ``str(error)`` names the model; callers that know more (the MD step) can
    re-raise with a prefix: ``raise NonFiniteError(f"step {n}: {error}", error.model) from error``.
    """

    def __init__(self, message: str, model: str | None = None) -> None:
        super().__init__(message)
        self.model = model


def check_positive_length(owner: str, name: str, value) -> float:
    """``value`` as a float if it is a finite positive length (Å); otherwise ``ValueError`` naming ``owner`` and ``name``."""
    try:
        length = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name} must be a positive number of Å, got {value!r}") from None
    if not (math.isfinite(length) and length > 0):
        raise ValueError(f"{owner}: {name} must be a finite positive number of Å, got {value!r}")
    return length


@dataclass
class LocalView:
    """A model's window on the system.

    Attributes
    ----------
    positions : (R, 3) coordinates of the view's rows: ``n_owned`` owned rows,
        then ghost images as explicit coordinates.
    numbers : (R,) atomic numbers of the rows.
    n_owned : number of owned rows.
    cell, pbc : the global cell (rows are lattice vectors) and periodicity.
    pairs : (2, P) directed pairs ``(i, j)`` with ``i < n_owned`` and
        ``|r_j - r_i| <= cutoff`` (the model's cutoff). When ``half_list``:
        each unordered pair within ``cutoff + skin`` with an owned end once,
        owned end first (owned-owned pairs once), the same tensor object
        until the next rebuild (so the model may cache what it derives from
        them); the model masks by its cutoff itself. May be given as a
        :class:`~halopipe.neighbors.GroupedPairs`, whose ``(2, P)`` tensor is
        then made on first read (:attr:`half_pairs` reads the int32 form), or
        as a function of no arguments that makes either on first read (the
        domain's views do, so a model that reads only
        :attr:`one_holder_pairs` never pays for the whole half list).
    vectors, distances : ``r_j - r_i`` and its length, differentiable (None
        when ``half_list``).
    fields : per-atom inputs on all R rows.
    refresh : ``x_owned (n_owned, ...) -> x_rows (R, ...)``, differentiable.
    global_sum : differentiable sum over all ranks.
    fold : ``x_ghost (R - n_owned, ...) -> (n_owned, ...)``: each ghost
        row's value added to its owner's row (on whichever rank owns it),
        differentiable (its backward refreshes). A collective: call it on
        every rank alike.
    one_holder : makes :attr:`one_holder_pairs` (None without a half list).
    mesh_transform : ``(sizes, decomposition="auto") -> MeshTransform``, the
        3-D FFT of a periodic mesh shared by all ranks in slabs or pencils
        (:mod:`halopipe.meshfft`; local on one process).
    n_total : number of atoms in the whole system.
    ids : (R,) global atom index of each row (owner's index for ghosts).
    half_list : ``pairs`` is a half candidate list (given to models that set
        ``half_list = True``).
    need_energy, need_virial : whether the caller uses the energies and the
        virial of a direct evaluation (LAMMPS's ``eflag`` and ``vflag``): most
        MD steps want forces only, so a direct model may then return
        ``energies`` or ``virial`` as None and skip their work. The forces must
        not depend on these flags. Evaluations through autograd ignore them.
    system, system_sizes : in a view of a whole batch (given to models that
        set ``batchable = True``): ``(R,)`` index of each row's system and
        ``(B,)`` atoms per system; ``cell`` is then ``(B, 3, 3)`` and ``pbc``
        ``(B, 3)``. None for one system.
    """

    positions: torch.Tensor
    numbers: torch.Tensor
    n_owned: int
    cell: torch.Tensor
    pbc: torch.Tensor
    pairs: torch.Tensor
    vectors: torch.Tensor | None
    distances: torch.Tensor | None
    fields: dict[str, torch.Tensor]
    refresh: Callable[[torch.Tensor], torch.Tensor]
    global_sum: Callable[[torch.Tensor], torch.Tensor]
    n_total: int
    ids: torch.Tensor
    cutoff: float = 0.0
    half_list: bool = False
    mesh_transform: Callable | None = None
    need_energy: bool = True
    need_virial: bool = True
    system: torch.Tensor | None = None
    system_sizes: torch.Tensor | None = None
    fold: Callable[[torch.Tensor], torch.Tensor] | None = None
    one_holder: Callable[[], GroupedPairs] | None = None

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def one_holder_pairs(self) -> GroupedPairs:
        """The half list less the pairs with a ghost that another holder of the pair evaluates (LAMMPS's ``newton on``).

        Over all ranks (and over a periodic image and its original on one
        rank) each pair of the system is in exactly one view's list, so a
        direct pair model evaluates it once, gives the ghost end its force and
        energy share, and sends those home with :attr:`fold`. The same object
        until the next rebuild; made on first read.
        """
        if self.one_holder is None:
            raise RuntimeError("LocalView.one_holder_pairs: this view has no half list (set half_list = True on the model)")
        return self.one_holder()

    @property
    def half_pairs(self) -> GroupedPairs | None:
        """The half list in the kernels' int32 form grouped by owned row, when the view was given one (else None).

        The same object until the next rebuild. Kernels that read it never
        make the ``(2, P)`` int64 :attr:`pairs`.
        """
        pairs = _given_pairs(self)
        return pairs if isinstance(pairs, GroupedPairs) else None

    @property
    def pair_offsets(self) -> torch.Tensor | None:
        """``(n_owned + 1,)`` int32 offsets of the half list grouped by owned row (row ``a``'s pairs are
        ``pair_offsets[a] .. pair_offsets[a + 1]``), when the view was given one (:attr:`half_pairs`), else None."""
        grouped = self.half_pairs
        return None if grouped is None else grouped.start

    def replace(self, **changes) -> LocalView:
        """A copy with ``changes`` (as :func:`dataclasses.replace`), keeping a grouped half list grouped."""
        return replace(self, **{"pairs": self.__dict__["_pairs"], **changes})

    @property
    def n_systems(self) -> int:
        return 1 if self.system_sizes is None else int(self.system_sizes.shape[0])

    def system_sum(self, x_owned: torch.Tensor) -> torch.Tensor:
        """Per-system sums ``(B, ...)`` of a per-atom tensor of the owned rows, over all ranks (differentiable).

        ``(1, ...)`` for a view of one system (its :attr:`global_sum`); in a
        batch view each system's rows are summed apart, so no sum crosses systems.
        """
        if self.system is None:
            return self.global_sum(x_owned.sum(0)).unsqueeze(0)
        out = x_owned.new_zeros((self.n_systems,) + tuple(x_owned.shape[1:]))
        return self.global_sum(out.index_add(0, self.system[: self.n_owned], x_owned))

    def atoms_per_system(self) -> torch.Tensor:
        """``(B,)`` atoms in each system (``(1,)`` holding ``n_total`` for one system)."""
        if self.system_sizes is None:
            return torch.tensor([self.n_total], device=self.positions.device)
        return self.system_sizes

    def owned_system(self) -> torch.Tensor:
        """``(n_owned,)`` system index of each owned row (zeros for one system)."""
        if self.system is None:
            return torch.zeros(self.n_owned, dtype=torch.int64, device=self.positions.device)
        return self.system[: self.n_owned]


def _given_pairs(view: LocalView) -> torch.Tensor | GroupedPairs:
    """The pairs as given, made first when they were given as a function."""
    pairs = view.__dict__["_pairs"]
    if callable(pairs):
        pairs = view.__dict__["_pairs"] = pairs()
    return pairs


def _get_pairs(view: LocalView) -> torch.Tensor:
    pairs = _given_pairs(view)
    return pairs.pairs if isinstance(pairs, GroupedPairs) else pairs


def _set_pairs(view: LocalView, pairs: torch.Tensor | GroupedPairs) -> None:
    view.__dict__["_pairs"] = pairs


# ``pairs`` stays a dataclass field (a constructor argument, kept by ``replace``) that reads as a (2, P) tensor,
# while a half list given grouped is materialized only when some model reads it.
LocalView.pairs = property(_get_pairs, _set_pairs, doc="(2, P) int64 pairs (see the class docstring).")


@dataclass
class ModelOutput:
    """What a model returns for its view.

    ``energies`` (n_owned,) per-atom energies, eV; or, in an evaluation
    through autograd, (R,): one per row of the view, where the ghost rows
    hold energy shares that belong to their owners (a pair evaluated once,
    half of it on its ghost end: :func:`pair_energies_once`). The pipeline
    counts those where they lie and folds them home (outside the graph)
    only where per-atom energies are reported, so the evaluation exchanges
    nothing for them. A per-row array cannot be mistaken for an owned one:
    adding an owned-sized term to it, or weighting it per owned atom, fails
    on the shapes (:func:`add_to_owned` adds such terms). ``fields`` produced per-atom
    tensors for the owned rows. ``forces`` (R, 3) and ``virial`` (3, 3) only for
    direct-force evaluation; ``forces`` has only the owned rows, (n_owned, 3),
    for a model whose ``ghost_forces`` is False. ``virial`` is this view's share of
    ``W = -dE/d(strain)``, which for a translation-invariant energy equals
    ``sum_i r_i (x) f_i`` over the view's rows (:func:`virial_from_forces`);
    stress is ``-W / volume``. A direct evaluation may leave ``energies`` or
    ``virial`` None when its view does not need them (``LocalView.need_energy``,
    ``need_virial``).
    """

    energies: torch.Tensor | None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    forces: torch.Tensor | None = None
    virial: torch.Tensor | None = None


class Model(torch.nn.Module):
    """Base class of interatomic models.

    Subclasses set ``cutoff`` (Å, the neighbour list the model needs; 0 for
    none: the view then holds no pairs), and may
    set ``inputs`` / ``outputs`` (names of per-atom fields consumed / produced),
    ``direct_forces`` (True if :meth:`forward` can return forces and virial
    without autograd), ``ghost_forces`` (False if those direct forces are
    complete on the owned rows, so no ghost row's force has to be folded home:
    each pair with a ghost is then evaluated by both ranks that hold it, as
    LAMMPS's ``newton off``), ``half_list`` (True to receive the unfiltered half
    candidate list, see :class:`LocalView`; with ``one_holder_list = True`` besides, the model says it reads
    only :attr:`LocalView.one_holder_pairs`, which the domain then searches directly, with no whole half
    list made for it) and override :attr:`halo` when ghost atoms further than
    the cutoff are needed. ``batchable = True`` says the model can take a whole batch of systems in
    one view (:mod:`halopipe.batch`): its energy is a sum of terms over the rows and pairs it is
    given, it never reads ``cell``, ``pbc`` or ``n_total``, and any sum over atoms goes through
    :meth:`LocalView.system_sum`; other models see one view per system of a batch. ``stages`` is a
    :class:`~halopipe.models.compile.CompiledStages` for models whose local work can run under
    ``torch.compile`` (``Pipeline(compile=True)``); None for the others. ``own_dtype = True`` says
    the model runs at its parameters' dtype whatever the system's (an MLIP's trained precision: it
    casts the view's geometry to it and its energies back), so a run's ``precision`` does not cast it.
    """

    cutoff: float = 0.0
    inputs: frozenset[str] = frozenset()
    outputs: frozenset[str] = frozenset()
    direct_forces: bool = False
    ghost_forces: bool = True
    half_list: bool = False
    one_holder_list: bool = False
    batchable: bool = False
    own_dtype: bool = False
    stages: CompiledStages | None = None

    @property
    def halo(self) -> float:
        """Width of the ghost shell (Å) the model needs around owned atoms."""
        return float(self.cutoff)

    @property
    def name(self) -> str:
        return type(self).__name__

    def forward(self, view: LocalView, direct: bool = False) -> ModelOutput:  # pragma: no cover - interface
        raise NotImplementedError


def virial_from_forces(positions: torch.Tensor, forces: torch.Tensor) -> torch.Tensor:
    """Virial ``W = sum_i r_i (x) f_i`` (= ``-dE/d(strain)`` for a translation-invariant energy)."""
    return positions.transpose(0, 1) @ forces


def fold_ghost_shares(view: LocalView, forces: torch.Tensor, energies: torch.Tensor | None = None):
    """Owned forces (and energies) made complete: the ghost rows' shares added to their owners by one :attr:`~LocalView.fold`.

    For a direct evaluation over :attr:`LocalView.one_holder_pairs`:
    ``forces`` (R, 3) and ``energies`` (R,) or None on every row of ``view``;
    returns them on the owned rows (energies None when given None).
    """
    n = view.n_owned
    if energies is None:
        return forces[:n] + view.fold(forces[n:]), None
    home = view.fold(torch.cat([forces[n:], energies[n:, None]], dim=1))
    return forces[:n] + home[:, :3], energies[:n] + home[:, 3]


def pair_energies_once(view: LocalView, lists: HalfListCache, energies_of: Callable[[HalfList, int], torch.Tensor]) -> torch.Tensor:
    """Per-row energies of a pair sum, each pair of the system evaluated once (differentiable).

    ``energies_of(half, n)`` gives per-row energies of the pairs in ``half``
    (half of each pair to each end) on the first ``n`` rows, differentiable.
    Over :attr:`LocalView.one_holder_pairs` it runs for every row and the
    result has one entry per row of the view, ghost rows holding their
    owners' shares, for ``ModelOutput(energies=...)`` (see
    :class:`ModelOutput`: the pipeline counts them where they lie, where
    folding them home in the graph cost two exchanges an evaluation, the
    fold and its backward). A view without a domain's lists (made by hand)
    has each pair with a ghost evaluated by every holder instead: owned rows
    only, at weight 1. ``lists`` keeps the model's converted list from step
    to step.
    """
    if view.one_holder is None:
        return energies_of(lists.get(view), view.n_owned)
    return energies_of(lists.get(view, one_holder=True), view.n_rows)


def add_to_owned(energies: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """``energies`` (per owned row, or per row of a view: :class:`ModelOutput`) plus ``owned`` (n_owned,) on its owned rows.

    Differentiable; the per-row form keeps its ghost rows' shares.
    """
    n = owned.shape[0]
    return torch.cat([energies[:n] + owned, energies[n:]])


def direct_by_local_autograd(energy_fn: Callable[[LocalView], torch.Tensor], view: LocalView) -> ModelOutput:
    """Direct forces and virial of an energy that depends on row positions only.

    Differentiates ``energy_fn(view)`` with respect to the view's rows inside
    the model, so the model can sit in a direct group. Collectives used by the
    energy (``refresh``, ``global_sum``) are differentiated collectively: every
    rank runs this at the same step, so their backward passes meet. Valid when
    the energy depends on the cell only through the rows (pair and many-body
    terms; not Ewald's reciprocal sum): then the virial is ``sum_rows r (x) f``.
    """
    with torch.enable_grad():
        rows = view.positions.detach().requires_grad_(True)
        if view.half_list:  # the model's kernels read rows directly
            local = view.replace(positions=rows)
        else:
            vectors = rows[view.pairs[1]] - rows[view.pairs[0]]
            local = view.replace(positions=rows, vectors=vectors, distances=vectors.norm(dim=1))
        energies = energy_fn(local)
        total = energies.sum() + 0.0 * rows.sum()  # keeps a graph on a rank without atoms
        (grad,) = torch.autograd.grad(total, rows)
    forces = -grad
    return ModelOutput(energies=energies.detach(), forces=forces, virial=virial_from_forces(rows.detach(), forces))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` within the block (float32 or float64; others leave it as it is).

    For building a model whose constructor makes tensors at torch's default
    dtype (sevenn's, mace-torch's), whatever the caller's default is.
    """
    old = torch.get_default_dtype()
    if dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
