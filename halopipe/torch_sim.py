"""A halopipe :class:`~halopipe.Pipeline` as a torch-sim model.

torch-sim (``pip install "halopipe[torchsim]"``, package ``torch-sim-atomistic``)
integrates and relaxes many systems at once, all of them in one batched
``SimState``. :class:`TorchSimModel` implements its ``ModelInterface``, so any
halopipe composite (an ML potential with D3, charges wired into Ewald/PME,
Lennard-Jones next to anything) runs under torch-sim's integrators,
optimisers and autobatchers.

Conventions (torch-sim 0.3.0): ``state.cell`` holds the lattice vectors as
*columns* (``state.row_vector_cell`` is halopipe's and ASE's rows); atoms of
one system are contiguous, labelled by ``state.system_idx``; ``state.pbc`` is
one flag for all axes and systems. torch-sim's stress is ``(1/V) dE/dε`` in
eV/Å³, the sign ASE and halopipe use, so it passes through unchanged.

The whole state is one batched pipeline call (``pipeline([s1, s2, ...])``,
:mod:`halopipe.batch`): per-system energy and stress, each system's own cell
and images, and plans and pair lists reused between calls until some atom
moved more than ``skin / 2``, as in halopipe's own dynamics. Under a process
group of several ranks the batch is placed over the ranks as a plain batch
call is: large systems split in space, small ones whole on one rank each
(every rank must hold the same state then).

Importing :mod:`halopipe` never imports torch-sim; importing this module
without it raises ``ImportError`` naming the install command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .models.base import Model
from .pipeline import Pipeline
from .system import System

try:
    import torch_sim as ts
    from torch_sim.models.interface import ModelInterface
except ImportError as exc:  # the extra is optional: say how to get it
    raise ImportError(
        'halopipe.torch_sim needs torch-sim: pip install "halopipe[torchsim]" (or pip install torch-sim-atomistic==0.3.0; Python >= 3.11)'
    ) from exc

__all__ = ["TorchSimModel"]

FieldSource = Callable[[System], Mapping[str, torch.Tensor]]


class TorchSimModel(ModelInterface):
    """A halopipe pipeline (or single model) as a torch-sim ``ModelInterface``.

    Parameters
    ----------
    pipeline : a :class:`~halopipe.Pipeline` or a :class:`~halopipe.Model` (wrapped).
    device : where states are evaluated; the pipeline is moved there.
    dtype : the model's dtype, which torch-sim's runners give the states
        they build; a state of another dtype is evaluated in its own.
    compute_stress, compute_forces : whether ``forward`` returns ``stress``
        and ``forces``. Stress needs every system's cell to span three dimensions.
    fields : per-atom input fields the pipeline needs and no step produces
        (a torch-sim state cannot carry them, e.g. fixed ``charges``): a dict
        of per-species values ``{name: {Z: value}}``, or a callable
        ``fields(system) -> {name: (n_atoms, ...) tensor}`` called on each
        system (a :class:`~halopipe.System` without fields) at every evaluation.

    Raises
    ------
    ValueError
        At construction, when the pipeline needs a field that ``fields`` (a
        dict) does not give.
    """

    def __init__(
        self,
        pipeline: Pipeline | Model,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float64,
        compute_stress: bool = True,
        compute_forces: bool = True,
        fields: Mapping[str, Mapping[int, float]] | FieldSource | None = None,
    ) -> None:
        super().__init__()
        self._device = torch.device(device)
        self._dtype = dtype
        self._compute_stress = bool(compute_stress)
        self._compute_forces = bool(compute_forces)
        self.pipeline = (pipeline if isinstance(pipeline, Pipeline) else Pipeline([pipeline])).to(self._device)
        self._field_source = fields if callable(fields) else None
        self._field_tables = {} if callable(fields) else _species_tables(fields or {}, self.pipeline.required_fields())

    def forward(self, state: ts.SimState | dict, **kwargs) -> dict[str, torch.Tensor]:
        """Energy ``(n_systems,)``, forces ``(n_atoms, 3)`` and stress ``(n_systems, 3, 3)`` of a batched state.

        Parameters
        ----------
        state : a torch-sim ``SimState`` (or its dict of tensors); it is not modified.
        **kwargs : accepted for torch-sim's interface, unused.

        Returns
        -------
        dict with ``energy`` (eV), ``forces`` (eV/Å) when ``compute_forces``
        and ``stress`` (eV/Å³, ASE sign) when ``compute_stress``, detached, in
        the state's dtype.
        """
        if isinstance(state, dict):  # torch-sim's models take its dict form too; the pipeline does not use masses
            state = ts.SimState(**{"masses": torch.ones_like(state["positions"][:, 0]), **state})
        out = self.pipeline(self._systems(state), stress=self._compute_stress)  # one batched call: per-system energy and stress
        dtype = state.positions.dtype
        result = {"energy": out["energy"].detach().to(dtype)}
        if self._compute_forces:
            result["forces"] = out["forces"].detach().to(dtype)
        if self._compute_stress:
            result["stress"] = out["stress"].detach().to(dtype)
        return result

    def _systems(self, state: ts.SimState) -> list[System]:
        """The state's systems as halopipe Systems (cell rows; input fields filled in)."""
        counts = state.n_atoms_per_system.tolist()
        rows = state.row_vector_cell
        pbc = torch.as_tensor(state.pbc, device=state.device)
        parts = zip(torch.split(state.positions, counts), torch.split(state.atomic_numbers, counts), torch.split(state.masses, counts))
        systems = []
        for b, (positions, numbers, masses) in enumerate(parts):
            fields = {name: _lookup(name, table, numbers) for name, table in self._field_tables.items()}
            system = System(positions=positions, numbers=numbers, cell=rows[b], pbc=pbc, masses=masses, fields=fields)
            if self._field_source is not None:
                system = system.replace(fields=dict(self._field_source(system)))
            systems.append(system)
        return systems


def _species_tables(fields: Mapping[str, Mapping[int, float]], required: set[str]) -> dict[str, torch.Tensor]:
    """Per-species lookup tables (NaN where no value is given) of the fields the pipeline requires."""
    missing = sorted(required - set(fields))
    if missing:
        raise ValueError(
            f"TorchSimModel: the pipeline needs the per-atom field(s) {missing}, which no step produces and a torch-sim state "
            f"cannot carry; pass fields={{{missing[0]!r}: {{Z: value, ...}}}} (per-species values) or a callable "
            "fields(system) -> {name: tensor}, or wire a model that produces them"
        )
    tables = {}
    for name, values in fields.items():
        if not isinstance(values, Mapping):
            raise TypeError(f"TorchSimModel: fields[{name!r}] must map atomic numbers to values, got {type(values).__name__}")
        table = torch.full((119,), float("nan"), dtype=torch.float64)
        for z, value in values.items():
            table[int(z)] = float(value)
        tables[name] = table
    return tables


def _lookup(name: str, table: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
    values = table.to(numbers.device)[numbers]
    unknown = torch.isnan(values)
    if bool(unknown.any()):
        raise ValueError(f"TorchSimModel: fields[{name!r}] has no value for atomic number {int(numbers[unknown][0])}")
    return values
