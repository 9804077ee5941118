"""Atomic systems: positions, species, cell and per-atom fields.

A :class:`System` is the single-process description of what is simulated. It is
immutable in spirit: methods that change it return a new one. Rows of the cell
are lattice vectors; ``pbc[a]`` says whether axis ``a`` is periodic. Per-atom
fields (``charges``, ``velocities``, ...) travel with the atoms through
partitioning and migration.

Two atoms closer than ``min_distance`` (0.5 Å by default, far below any
chemical bond, the shortest being H2's 0.74 Å) are a broken structure (a
duplicated atom, wrong units, a bad cell), and most potentials return ``inf``
or ``nan`` for them. :meth:`System.check_close_contacts` finds them with a
neighbour search (linear in the number of atoms); it runs once at setup, when
:meth:`~halopipe.distributed.ShardedSystem.scatter` distributes a system and when a
:class:`~halopipe.Pipeline` first sees one, not at every construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch

__all__ = ["DEFAULT_MIN_DISTANCE", "System", "standard_masses"]

#: Default closest approach of two atoms (Å) below which a structure is rejected.
DEFAULT_MIN_DISTANCE = 0.5


def standard_masses(numbers: torch.Tensor) -> torch.Tensor:
    """Standard atomic masses (amu) of the given atomic numbers, from ASE."""
    from ase.data import atomic_masses

    table = torch.as_tensor(atomic_masses, dtype=torch.float64)
    return table[numbers.cpu()].to(numbers.device)


def _as_float(x, dtype, device, name: str) -> torch.Tensor:
    try:
        return torch.as_tensor(x, dtype=dtype, device=device)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"System: {name} could not be converted to a {dtype} tensor: {exc}") from exc


@dataclass
class System:
    """Atoms in a (possibly periodic) cell.

    Parameters
    ----------
    positions : (N, 3) float tensor, Å.
    numbers : (N,) int64 tensor of atomic numbers in 1..118.
    cell : (3, 3) tensor whose rows are lattice vectors, Å. May be zero on
        non-periodic axes.
    pbc : (3,) bool tensor.
    masses : (N,) tensor in amu; defaults to standard atomic masses.
    fields : per-atom tensors whose first dimension is N (e.g. ``charges``).
    min_distance : closest two atoms (or an atom and a periodic image) may be,
        Å; checked at setup by :meth:`check_close_contacts`. 0 disables it.
    """

    positions: torch.Tensor
    numbers: torch.Tensor
    cell: torch.Tensor | None = None
    pbc: torch.Tensor | None = None
    masses: torch.Tensor | None = None
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    min_distance: float = DEFAULT_MIN_DISTANCE

    def __post_init__(self) -> None:
        positions = self.positions
        dtype = positions.dtype if isinstance(positions, torch.Tensor) and positions.is_floating_point() else torch.float64
        device = positions.device if isinstance(positions, torch.Tensor) else torch.device("cpu")
        self.positions = _as_float(positions, dtype, device, "positions")
        self.numbers = torch.as_tensor(self.numbers, device=device).to(torch.int64)
        self.cell = torch.zeros(3, 3, dtype=dtype, device=device) if self.cell is None else _as_float(self.cell, dtype, device, "cell")
        self.pbc = (
            torch.zeros(3, dtype=torch.bool, device=device)
            if self.pbc is None
            else torch.as_tensor(self.pbc, device=device).to(torch.bool).reshape(-1)
        )
        if self.pbc.numel() == 1:
            self.pbc = self.pbc.repeat(3)
        if self.masses is None:
            bad = (self.numbers < 1) | (self.numbers > 118)
            safe = torch.where(bad, torch.ones_like(self.numbers), self.numbers)  # validate() names the bad number
            self.masses = standard_masses(safe).to(dtype)
        else:
            self.masses = _as_float(self.masses, dtype, device, "masses")
        self.fields = {k: torch.as_tensor(v, device=device) for k, v in dict(self.fields).items()}
        self.fields = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.fields.items()}
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent value."""
        pos, num = self.positions, self.numbers
        if pos.ndim != 2 or pos.shape[1] != 3:
            raise ValueError(f"System: positions must have shape (N, 3), got {tuple(pos.shape)}")
        n = pos.shape[0]
        if num.shape != (n,):
            raise ValueError(f"System: numbers must have shape ({n},) to match positions, got {tuple(num.shape)}")
        bad = ~torch.isfinite(pos).all(dim=1)
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"System: atom {i} has a non-finite position {pos[i].tolist()}; check the input structure")
        out = (num < 1) | (num > 118)
        if out.any():
            i = int(out.nonzero()[0])
            raise ValueError(f"System: atom {i} has atomic number {int(num[i])}, outside 1..118")
        if self.cell.shape != (3, 3):
            raise ValueError(f"System: cell must have shape (3, 3), got {tuple(self.cell.shape)}")
        if not torch.isfinite(self.cell).all():
            raise ValueError(f"System: cell has non-finite entries: {self.cell.tolist()}")
        if self.pbc.shape != (3,):
            raise ValueError(f"System: pbc must have 3 entries, got {tuple(self.pbc.shape)}")
        if self.pbc.any():
            self._check_periodic_cell()
        if self.masses.shape != (n,):
            raise ValueError(f"System: masses must have shape ({n},), got {tuple(self.masses.shape)}")
        if (self.masses <= 0).any() or not torch.isfinite(self.masses).all():
            i = int(((self.masses <= 0) | ~torch.isfinite(self.masses)).nonzero()[0])
            raise ValueError(f"System: atom {i} has mass {float(self.masses[i])}; masses must be positive and finite")
        for name, value in self.fields.items():
            if value.ndim == 0 or value.shape[0] != n:
                raise ValueError(
                    f"System: field '{name}' has shape {tuple(value.shape)}; its first dimension must be the number of atoms ({n})"
                )
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise ValueError(f"System: field '{name}' has non-finite values")
        if not (isinstance(self.min_distance, (int, float)) and math.isfinite(self.min_distance) and self.min_distance >= 0):
            raise ValueError(f"System: min_distance must be a finite number of Å >= 0, got {self.min_distance!r}")

    def check_close_contacts(self) -> None:
        """Raise ``ValueError`` naming the closest two atoms if they are nearer than ``min_distance``.

        Periodic images count: an atom may also be too close to an image of
        another (or of itself, in a tiny cell). Uses a neighbour search within
        ``min_distance``, linear in the number of atoms.
        """
        if self.min_distance == 0 or self.n_atoms == 0:
            return
        from .neighbors import neighbor_list  # vesin, imported when first needed

        pos, cell = self.positions.detach().to(torch.float64).cpu(), self.cell.detach().to(torch.float64).cpu()
        i, j, shifts = neighbor_list(pos, cell, self.pbc.cpu(), self.min_distance, full=False)
        if i.numel() == 0:
            return
        distances = (pos[j] + shifts.to(torch.float64) @ cell - pos[i]).norm(dim=1)
        close = distances < self.min_distance
        if not bool(close.any()):
            return
        k = int(torch.argmin(torch.where(close, distances, torch.inf)))
        a, b = int(i[k]), int(j[k])
        others = int(close.sum()) - 1
        raise ValueError(
            f"System: {self._atom_label(a)} and {'its own periodic image' if a == b else self._atom_label(b)} are "
            f"{float(distances[k]):.4g} Å apart, closer than min_distance={self.min_distance:g} Å"
            + (f" ({others} more pair(s) too close)" if others else "")
            + "; the structure has overlapping atoms (a duplicated atom, wrong units or cell?). "
            "Fix the structure, or lower System.min_distance if such contacts are intended"
        )

    def _atom_label(self, index: int) -> str:
        from ase.data import chemical_symbols

        return f"atom {index} ({chemical_symbols[int(self.numbers[index])]})"

    def _check_periodic_cell(self) -> None:
        cell = self.cell.detach().to(torch.float64).cpu()
        periodic = cell[self.pbc.cpu()]
        lengths = periodic.norm(dim=1)
        if (lengths < 1e-8).any():
            axis = int(self.pbc.nonzero()[int((lengths < 1e-8).nonzero()[0])])
            raise ValueError(f"System: axis {axis} is periodic but its lattice vector is zero; set a cell or make the axis non-periodic")
        # The periodic lattice vectors must be linearly independent.
        sv = torch.linalg.svdvals(periodic)
        if sv.min() < 1e-8 * max(float(sv.max()), 1.0):
            raise ValueError(
                f"System: the periodic lattice vectors are linearly dependent (cell {cell.tolist()}); "
                "the cell is singular on a periodic axis"
            )

    # ------------------------------------------------------------ conveniences
    @property
    def n_atoms(self) -> int:
        return int(self.positions.shape[0])

    def __len__(self) -> int:
        return self.n_atoms

    @property
    def dtype(self) -> torch.dtype:
        return self.positions.dtype

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def volume(self) -> float:
        return float(torch.linalg.det(self.cell.detach().to(torch.float64)).abs())

    def replace(self, **changes) -> System:
        """A copy with some attributes replaced (fields dict is copied)."""
        changes.setdefault("fields", dict(self.fields))
        return replace(self, **changes)

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> System:
        """A copy converted to ``dtype`` (floating tensors) and/or ``device``."""

        def conv(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device) if device is not None else t
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        return System(
            positions=conv(self.positions),
            numbers=conv(self.numbers),
            cell=conv(self.cell),
            pbc=conv(self.pbc),
            masses=conv(self.masses),
            fields={k: conv(v) for k, v in self.fields.items()},
            min_distance=self.min_distance,
        )

    # -------------------------------------------------------------------- ASE
    @classmethod
    def from_ase(cls, atoms, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> System:
        """Build a System from ``ase.Atoms``; initial charges and velocities become fields."""
        fields: dict[str, np.ndarray] = {}
        if atoms.has("initial_charges"):
            fields["charges"] = atoms.get_initial_charges()
        if atoms.has("momenta"):
            fields["velocities"] = atoms.get_velocities() * _ASE_VELOCITY_TO_A_PER_FS
        for name, value in atoms.arrays.items():
            if name not in ("positions", "numbers", "initial_charges", "momenta", "masses", "initial_magmoms"):
                fields[name] = value
        t = lambda x: torch.as_tensor(np.asarray(x), dtype=dtype, device=device)  # noqa: E731
        return cls(
            positions=t(atoms.get_positions()),
            numbers=torch.as_tensor(atoms.get_atomic_numbers(), dtype=torch.int64, device=device),
            cell=t(atoms.get_cell().array),
            pbc=torch.as_tensor(atoms.get_pbc(), device=device),
            masses=t(atoms.get_masses()) if atoms.has("masses") else None,  # standard masses, after the numbers are checked
            fields={k: torch.as_tensor(np.asarray(v), device=device) for k, v in fields.items()},
        )

    def to_ase(self):
        """Convert to ``ase.Atoms`` (charges and velocities are restored)."""
        from ase import Atoms

        npy = lambda x: x.detach().cpu().numpy()  # noqa: E731
        atoms = Atoms(
            numbers=npy(self.numbers),
            positions=npy(self.positions).astype(np.float64),
            cell=npy(self.cell).astype(np.float64),
            pbc=npy(self.pbc),
            masses=npy(self.masses).astype(np.float64),
        )
        for name, value in self.fields.items():
            if name == "charges":
                atoms.set_initial_charges(npy(value))
            elif name == "velocities":
                atoms.set_velocities(npy(value) / _ASE_VELOCITY_TO_A_PER_FS)
            else:
                atoms.set_array(name, npy(value))
        return atoms


def _ase_velocity_factor() -> float:
    from ase import units

    # ASE velocities are in Å / (ASE time unit); halopipe uses Å/fs.
    return units.fs


_ASE_VELOCITY_TO_A_PER_FS = _ase_velocity_factor()
