"""Constant pressure: Martyna-Tobias-Klein (MTK) barostats and stochastic cell rescaling, isotropic or anisotropic.

In NPT the cell is a dynamical variable. The MTK equations (Martyna, Tobias &
Klein, J. Chem. Phys. 101, 4177 (1994); the integrator of Martyna, Tuckerman,
Tobias & Klein, Mol. Phys. 87, 1117 (1996)) give the cell a momentum driven by
the difference between the instantaneous pressure (virial plus kinetic) and
the target; the atoms and the barostat each couple to a Nosé-Hoover chain, so
the ensemble is isothermal-isobaric and an extended energy is conserved (its
drift is the integrator's health check).

* :class:`IsotropicMTKNPT`: the log-volume strain ``eps`` (``cell = cell0 *
  exp(eps)``, shape kept) with momentum ``p_eps`` and mass ``W``;
  ``H' = E_pot + E_kin + p_eps² / (2W) + P0 V + chains``.
* :class:`MTKNPT`: the fully flexible cell. A symmetric 3x3 momentum ``p_g``
  (mass ``W``) drives ``cell <- cell @ expm(dt p_g / W)`` (rows are lattice
  vectors), so the cell stretches along the eigenvectors of ``p_g`` and is
  never spun. A cell mask (Voigt ``xx yy zz yz xz xy``) keeps chosen
  components of ``p_g``, and so of the Cartesian strain rate, at zero. The
  target may be a pressure tensor; ``H' = E_pot + E_kin + tr(p_g²) / (2W) +
  P̄0 V + W_dev + chains`` with ``P̄0`` the mean target pressure and ``W_dev``
  the work of its deviatoric part (zero under hydrostatic pressure).

Under domain decomposition nothing here is per rank beyond a linear map of the
owned atoms' positions and velocities: every barostat variable is computed
from global sums (kinetic energy and tensor, stress), so all ranks take the
same step. The cell goes to the sharded system with
:meth:`~halopipe.distributed.ShardedSystem.set_cell`; bricks are fractional,
so they follow it, and the halo plan is rebuilt when the strain (any
deformation gradient) plus the atoms' motion exceeds the skin (see
:func:`~halopipe.domain.strain_displacement`).

The splitting and the masses follow ASE's ``IsotropicMTKNPT`` and ``MTKNPT``
(whose formulation is that of the 1996 paper), so they integrate the same
trajectories; the differences are counts of degrees of freedom: halopipe uses
``Nf = 3N - 3`` for the atoms (the total momentum is conserved and zero), ASE
``3N``; and :class:`MTKNPT`'s barostat chain thermostats the free independent
components of the symmetric ``p_g`` (6 for a free cell, as LAMMPS ``fix npt
tri``), where ASE's ``MTKNPT`` counts 9.

:class:`StochasticCellRescaling` (Bernetti & Bussi, J. Chem. Phys. 153,
114107 (2020)) is a first-order stochastic barostat: the log-volume follows
``d eps = -(beta/tau_p) (P0 - P_int - kT/V) dt + sqrt(2 kT beta / (V tau_p)) dW``
(``beta``: an estimate of the compressibility, which sets only the relaxation
speed). :class:`AnisotropicCellRescaling` is its fully flexible form (see its
docstring). Both relax fast without ringing and sample NPT, with a Langevin
thermostat here; they have no conserved quantity of the MTK kind.

Units: fs, K, eV, Å; target pressures are in bar.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from ase import units

from .integrators import Integrator, Langevin, MDState, _check_positive
from .random import BAROSTAT, gaussian
from .units import KB, KINETIC

__all__ = ["IsotropicMTKNPT", "MTKNPT", "StochasticCellRescaling", "AnisotropicCellRescaling", "BAR_TO_EV_PER_A3", "VOIGT"]

BAR_TO_EV_PER_A3 = units.bar
"""1 bar in eV/Å³."""

# Suzuki-Yoshida fourth-order weights for the chain propagation (MTK 1996, eq. 29).
_YOSHIDA = (1.0 / (2.0 - 2.0 ** (1.0 / 3.0)), -(2.0 ** (1.0 / 3.0)) / (2.0 - 2.0 ** (1.0 / 3.0)), 1.0 / (2.0 - 2.0 ** (1.0 / 3.0)))


def _exprel(x: float) -> float:
    """``(exp(x) - 1) / x``, 1 at 0 (the exact drift of a linear velocity scaling)."""
    return math.expm1(x) / x if x != 0.0 else 1.0


class NoseHooverChainVariables:
    """A Nosé-Hoover chain that thermostats a kinetic energy of ``dof`` degrees of freedom.

    Parameters
    ----------
    masses : the chain masses ``Q_j``, eV fs².
    kt : the target ``kB T``, eV.
    dof : degrees of freedom of the thermostatted kinetic energy.

    :meth:`propagate` advances the chain by ``delta`` (Suzuki-Yoshida
    order 4, ``loops`` substeps) given twice the kinetic energy, and returns
    the factor by which the thermostatted momenta are scaled.
    """

    def __init__(self, masses: list[float], kt: float, dof: float) -> None:
        self.masses, self.kt, self.dof = list(masses), float(kt), float(dof)
        self.positions = [0.0] * len(masses)
        self.momenta = [0.0] * len(masses)

    def energy(self) -> float:
        """Energy of the chain: ``dof kT xi_1 + kT sum_{j>1} xi_j + sum p_j² / 2Q_j``, eV."""
        kinetic = sum(0.5 * p * p / q for p, q in zip(self.momenta, self.masses))
        return self.dof * self.kt * self.positions[0] + self.kt * sum(self.positions[1:]) + kinetic

    def propagate(self, two_ke: float, delta: float, loops: int) -> float:
        scale = 1.0
        for _ in range(loops):
            for weight in _YOSHIDA:
                s = self._loop(two_ke, weight * delta / loops)
                scale *= s
                two_ke *= s * s
        return scale

    def _loop(self, two_ke: float, delta: float) -> float:
        m = len(self.masses)
        for j in reversed(range(m)):
            self._kick(j, two_ke, delta)
        for j in range(m):
            self.positions[j] += delta * self.momenta[j] / self.masses[j]
        s = math.exp(-delta * self.momenta[0] / self.masses[0])
        two_ke *= s * s
        for j in range(m):
            self._kick(j, two_ke, delta)
        return s

    def _kick(self, j: int, two_ke: float, delta: float) -> None:
        p, q = self.momenta, self.masses
        damp = math.exp(-0.25 * delta * p[j + 1] / q[j + 1]) if j + 1 < len(q) else 1.0
        force = two_ke - self.dof * self.kt if j == 0 else p[j - 1] ** 2 / q[j - 1] - self.kt
        p[j] = (p[j] * damp + 0.5 * delta * force) * damp

    def state_dict(self) -> dict:
        return {"positions": list(self.positions), "momenta": list(self.momenta)}

    def load_state_dict(self, state: dict, owner: str) -> None:
        if len(state["positions"]) != len(self.masses):
            raise ValueError(f"{owner}: the checkpoint has a chain of {len(state['positions'])}, this integrator {len(self.masses)}")
        self.positions = [float(x) for x in state["positions"]]
        self.momenta = [float(x) for x in state["momenta"]]


def _check_chain(owner: str, **values) -> None:
    for key, value in values.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{owner}: {key} must be an integer >= 1, got {value!r}")


VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))
"""Voigt order of the cell components: ``xx yy zz yz xz xy`` (as ASE's stress and cell filters)."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def _check_pressure(owner: str, pressure: float) -> float:
    if not _is_number(pressure):
        raise ValueError(f"{owner}: pressure must be a finite number of bar, got {pressure!r}")
    return float(pressure)


def target_pressure(owner: str, pressure) -> float | tuple[float, ...]:
    """A target pressure in bar, checked: a number (hydrostatic) or six Voigt components ``xx yy zz yz xz xy``.

    A symmetric 3x3 matrix is accepted and returned in Voigt form; positive
    components compress (the pressure tensor, the negative of ASE's stress).
    """
    if _is_number(pressure):
        return float(pressure)
    values = np.asarray(_plain(pressure), dtype=object)
    numeric = values.size > 0 and all(_is_number(v) for v in values.flat)
    if numeric and values.shape == (3, 3):
        if not all(values[i, j] == values[j, i] for i, j in VOIGT):
            raise ValueError(f"{owner}: a 3x3 pressure tensor must be symmetric (a stress exerts no torque), got {values.tolist()}")
        return tuple(float(values[i, j]) for i, j in VOIGT)
    if numeric and values.shape == (6,):
        return tuple(float(v) for v in values)
    raise ValueError(
        f"{owner}: pressure must be a finite number of bar, six Voigt components (xx, yy, zz, yz, xz, xy) "
        f"or a symmetric 3x3 matrix of them, got {pressure!r}"
    )


def _plain(value):
    """A tensor or array as nested Python lists (so that its elements are checked as numbers); anything else as is."""
    return value.tolist() if isinstance(value, (torch.Tensor, np.ndarray)) else value


def pressure_tensor(pressure: float | tuple[float, ...]) -> torch.Tensor:
    """A checked target (:func:`target_pressure`) as the (3, 3) float64 pressure tensor, eV/Å³."""
    if isinstance(pressure, float):
        return torch.eye(3, dtype=torch.float64) * (pressure * BAR_TO_EV_PER_A3)
    return _from_voigt(pressure) * BAR_TO_EV_PER_A3


def _from_voigt(values) -> torch.Tensor:
    tensor = torch.zeros(3, 3, dtype=torch.float64)
    for (i, j), v in zip(VOIGT, values):
        tensor[i, j] = tensor[j, i] = float(v)
    return tensor


def cell_mask(owner: str, mask) -> tuple[bool, ...]:
    """A checked cell mask as six Voigt booleans ``xx yy zz yz xz xy`` (``True``: free).

    ``None``: every component free; six booleans; or a symmetric 3x3 boolean
    matrix. At least one component must be free.
    """
    if mask is None:
        return (True,) * 6
    values = np.asarray(_plain(mask), dtype=object)
    booleans = values.size > 0 and all(isinstance(v, (bool, np.bool_)) for v in values.flat)
    if booleans and values.shape == (3, 3):
        if not all(values[i, j] == values[j, i] for i, j in VOIGT):
            raise ValueError(f"{owner}: a 3x3 cell mask must be symmetric (the strain rate is), got {values.tolist()}")
        free = tuple(bool(values[i, j]) for i, j in VOIGT)
    elif booleans and values.shape == (6,):
        free = tuple(bool(v) for v in values)
    else:
        raise ValueError(f"{owner}: mask must be six booleans (xx, yy, zz, yz, xz, xy) or a symmetric 3x3 boolean matrix, got {mask!r}")
    if not any(free):
        raise ValueError(f"{owner}: mask holds every cell component fixed; free at least one, or use an NVT integrator")
    return free


def kinetic_tensor(md: MDState) -> torch.Tensor:
    """``sum_i m_i v_i ⊗ v_i`` over all ranks, eV (float64 on the CPU, collective); its trace is twice the kinetic energy."""
    v = md.velocities.detach().to(torch.float64)
    local = (md.masses.to(torch.float64)[:, None, None] * v[:, :, None] * v[:, None, :]).sum(dim=0) * KINETIC
    return md.reduce(local.reshape(9)).reshape(3, 3).cpu()


def _host(x: torch.Tensor) -> torch.Tensor:
    """A small tensor (cell, stress) as float64 on the CPU, where the barostats' 3x3 algebra runs."""
    return x.detach().to("cpu", torch.float64)


def _exprel_tensor(x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``(exp(x) - 1) / x``, 1 at 0."""
    safe = torch.where(x == 0, torch.ones_like(x), x)
    return torch.where(x == 0, torch.ones_like(x), torch.expm1(safe) / safe)


class _MTKBase(Integrator):
    """What both MTK barostats share: parameters, the two chains, the splitting, checkpoints.

    One step (MTK 1996, as ASE): chains (dt/2), cell kick (dt/2), atom kick
    (dt/2), drift of positions and cell (dt) and the force call, atom kick,
    cell kick, chains. Subclasses hold the cell momentum and define the kicks,
    the drift and the cell's energy.
    """

    def __init__(self, timestep, temperature, tdamp, pdamp, tchain, pchain, tloop, ploop) -> None:
        super().__init__(timestep)
        tdamp = 100.0 * self.timestep if tdamp is None else tdamp
        pdamp = 1000.0 * self.timestep if pdamp is None else pdamp
        _check_positive(type(self).__name__, temperature=temperature, tdamp=tdamp, pdamp=pdamp)
        _check_chain(type(self).__name__, tchain=tchain, pchain=pchain, tloop=tloop, ploop=ploop)
        self.temperature, self.tdamp, self.pdamp = float(temperature), float(tdamp), float(pdamp)
        self.tchain, self.pchain, self.tloop, self.ploop = tchain, pchain, tloop, ploop
        self._atoms_chain: NoseHooverChainVariables | None = None
        self._cell_chain: NoseHooverChainVariables | None = None
        self._dof = 0

    # ------------------------------------------------------------ setup
    @property
    def _kt(self) -> float:
        return KB * self.temperature

    def _cell_chain_dof(self) -> tuple[float, int]:
        """(first mass in units of ``kT pdamp²``, degrees of freedom) of the barostat's chain."""
        raise NotImplementedError

    def _chains(self, dof: int) -> None:
        kt, tq, pq = self._kt, self._kt * self.tdamp**2, self._kt * self.pdamp**2
        self._dof = dof
        self._atoms_chain = NoseHooverChainVariables([dof * tq] + [tq] * (self.tchain - 1), kt, dof)
        first, cell_dof = self._cell_chain_dof()
        self._cell_chain = NoseHooverChainVariables([first * pq] + [pq] * (self.pchain - 1), kt, cell_dof)

    def setup(self, md: MDState, restarted: bool) -> None:
        if not md.can_stress:
            raise ValueError(f"{type(self).__name__}: constant pressure needs a cell periodic along all three axes")
        if self._atoms_chain is None:
            self._chains(self.dof(md.n_total))
        if not restarted:
            self._start_cell(md)
            self._chains(self.dof(md.n_total))
        if md.stress is None:  # the first force call of a run evaluates the stress only if a reporter asked
            md.want_stress = True
            md.compute()

    def _start_cell(self, md: MDState) -> None:
        """Reset the cell variables at the start of a fresh run."""
        raise NotImplementedError

    # ------------------------------------------------------------- step
    def step(self, md: MDState) -> None:
        dt, half = self.timestep, 0.5 * self.timestep
        self._thermostats(md, half)
        self._kick_cell(md, half)
        self._kick_atoms(md, half)
        self._drift(md, dt)
        self._kick_atoms(md, half)
        self._kick_cell(md, half)
        self._thermostats(md, half)

    def _volume(self, md: MDState) -> float:
        return float(torch.linalg.det(md.sharded.cell.detach().to(torch.float64)).abs())

    def _thermostats(self, md: MDState, delta: float) -> None:
        self._scale_cell_momentum(self._cell_chain.propagate(self._cell_two_ke(), delta, self.ploop))
        scale = self._atoms_chain.propagate(2.0 * float(md.kinetic_energy()), delta, self.tloop)
        md.velocities = md.velocities * scale

    def _cell_two_ke(self) -> float:
        """Twice the cell's kinetic energy, eV."""
        raise NotImplementedError

    def _scale_cell_momentum(self, scale: float) -> None:
        raise NotImplementedError

    def _kick_cell(self, md: MDState, delta: float) -> None:
        raise NotImplementedError

    def _kick_atoms(self, md: MDState, delta: float) -> None:
        raise NotImplementedError

    def _drift(self, md: MDState, delta: float) -> None:
        raise NotImplementedError

    # -------------------------------------------------------- reporting
    def _cell_energy(self, md: MDState) -> float:
        """The cell's kinetic energy plus the work of the target pressure, eV."""
        raise NotImplementedError

    def extra_energy(self, md: MDState) -> float:
        return self._atoms_chain.energy() + self._cell_chain.energy() + self._cell_energy(md)

    def _cell_state(self) -> dict:
        raise NotImplementedError

    def _load_cell_state(self, state: dict, md: MDState) -> None:
        raise NotImplementedError

    def state_dict(self, md: MDState) -> dict:
        return {**self._cell_state(), "thermostat": self._atoms_chain.state_dict(), "barostat": self._cell_chain.state_dict()}

    def load_state_dict(self, state: dict, md: MDState) -> None:
        self._chains(self.dof(md.n_total))
        self._atoms_chain.load_state_dict(state["thermostat"], f"{type(self).__name__} thermostat")
        self._cell_chain.load_state_dict(state["barostat"], f"{type(self).__name__} barostat")
        self._load_cell_state(state, md)


class IsotropicMTKNPT(_MTKBase):
    """NPT with isotropic cell fluctuations: MTK barostat and Nosé-Hoover chains.

    Parameters
    ----------
    timestep : fs.
    temperature : K.
    pressure : target pressure, bar (1 bar = 1e-4 GPa).
    tdamp : thermostat time constant, fs (default ``100 * timestep``).
    pdamp : barostat time constant, fs (default ``1000 * timestep``).
    tchain, pchain : lengths of the atoms' and the barostat's chains.
    tloop, ploop : chain substeps per half step.

    Masses: ``Q = (Nf kT tdamp², kT tdamp², ...)`` for the atoms' chain,
    ``W = (Nf + 3) kT pdamp²`` for the volume and ``R = (9 kT pdamp², kT
    pdamp², ...)`` for the barostat's chain, as in ASE. The conserved
    quantity is the extended energy of the module docstring. Needs a cell
    periodic along all three axes; the stress is evaluated at every step.
    """

    name = "MTK isotropic NPT"

    def __init__(
        self,
        timestep: float,
        temperature: float,
        pressure: float = 1.0,
        tdamp: float | None = None,
        pdamp: float | None = None,
        tchain: int = 3,
        pchain: int = 3,
        tloop: int = 1,
        ploop: int = 1,
    ) -> None:
        super().__init__(timestep, temperature, tdamp, pdamp, tchain, pchain, tloop, ploop)
        self.pressure = _check_pressure(type(self).__name__, pressure)
        self.eps = 0.0
        self.p_eps = 0.0
        self.cell0: torch.Tensor | None = None

    @property
    def barostat_mass(self) -> float:
        """``W``, eV fs²."""
        return (self._dof + 3) * self._kt * self.pdamp**2

    def _cell_chain_dof(self) -> tuple[float, int]:
        return 9.0, 1

    def _start_cell(self, md: MDState) -> None:
        self.cell0 = md.sharded.cell.detach().to(torch.float64).clone()
        self.eps = self.p_eps = 0.0

    def _cell_two_ke(self) -> float:
        return self.p_eps**2 / self.barostat_mass

    def _scale_cell_momentum(self, scale: float) -> None:
        self.p_eps *= scale

    def _kick_cell(self, md: MDState, delta: float) -> None:
        """``p_eps += delta * (3V (P_virial - P0) + (1 + 3/Nf) 2K)``."""
        volume = self._volume(md)
        two_ke = 2.0 * float(md.kinetic_energy())
        virial_term = -volume * float(torch.trace(md.stress))
        target = 3.0 * volume * self.pressure * BAR_TO_EV_PER_A3
        self.p_eps += delta * (virial_term - target + (1.0 + 3.0 / self._dof) * two_ke)

    def _kick_atoms(self, md: MDState, delta: float) -> None:
        """Forces and the volume's drag together, integrated exactly over ``delta``."""
        x = (1.0 + 3.0 / self._dof) * delta * self.p_eps / self.barostat_mass
        md.velocities = md.velocities * math.exp(-x) + (delta * _exprel(-x)) * md.accelerations()

    def _drift(self, md: MDState, delta: float) -> None:
        """Positions and cell scale together by ``exp(delta p_eps / W)``; then the new forces and stress."""
        x = delta * self.p_eps / self.barostat_mass
        md.positions = md.positions * math.exp(x) + (delta * _exprel(x)) * md.velocities
        self.eps += x
        md.sharded.set_cell(self.cell0 * math.exp(self.eps))
        md.want_stress = True
        md.compute()

    def _cell_energy(self, md: MDState) -> float:
        return 0.5 * self.p_eps**2 / self.barostat_mass + self.pressure * BAR_TO_EV_PER_A3 * self._volume(md)

    def _cell_state(self) -> dict:
        return {"eps": self.eps, "p_eps": self.p_eps, "cell0": self.cell0.cpu().tolist()}

    def _load_cell_state(self, state: dict, md: MDState) -> None:
        self.eps, self.p_eps = float(state["eps"]), float(state["p_eps"])
        self.cell0 = torch.tensor(state["cell0"], dtype=torch.float64, device=md.sharded.cell.device)

    def describe(self) -> str:
        return (
            f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, P = {self.pressure:g} bar, "
            f"tdamp = {self.tdamp:g} fs, pdamp = {self.pdamp:g} fs"
        )


class MTKNPT(_MTKBase):
    """NPT with a fully flexible (triclinic) cell: MTK barostat and Nosé-Hoover chains, with a cell mask.

    Parameters
    ----------
    timestep : fs.
    temperature : K.
    pressure : target, bar: a number (hydrostatic), six Voigt components
        ``xx yy zz yz xz xy`` or a symmetric 3x3 matrix of a pressure tensor
        (positive: compressive; the negative of ASE's stress).
    tdamp : thermostat time constant, fs (default ``100 * timestep``).
    pdamp : barostat time constant, fs (default ``1000 * timestep``).
    tchain, pchain : lengths of the atoms' and the barostat's chains.
    tloop, ploop : chain substeps per half step.
    mask : which components of the Cartesian strain rate may be non-zero:
        ``None`` (all: fully flexible), six booleans in Voigt order ``xx yy
        zz yz xz xy`` or a symmetric 3x3 boolean matrix. ``(1, 1, 1, 0, 0,
        0)``: no shear (each Cartesian extent of the cell scales on its own,
        LAMMPS ``aniso``); ``(0, 0, 1, 0, 0, 0)``: only z (uniaxial).

    Equations (MTK 1994, eqs. 2.9; integrated as MTK 1996 and ASE's
    ``MTKNPT``): with ``P_int = (sum m v⊗v - V σ)/V`` (σ: the virial stress),

    * ``dp_g/dt = mask ∘ [V (P_int - P0) + (2K/Nf) 1]``;
    * ``dr/dt = v + r p_g/W``, ``dcell/dt = cell p_g/W`` (rows are vectors);
    * ``dv/dt = F/m - v (p_g + tr(p_g)/Nf) / W``;

    both exponentials of the symmetric ``p_g`` are applied exactly in its
    eigenbasis. Masses: ``W = (Nf + 3)/3 kT pdamp²`` (a third of the
    isotropic one, ASE's ``(N + 1) kT pdamp²``), atoms' chain ``(Nf kT
    tdamp², kT tdamp², ...)``, barostat's chain ``(n kT pdamp², kT pdamp²,
    ...)`` with ``n`` = :attr:`cell_dof`, the free independent components of
    ``p_g`` (6 unmasked; ASE counts 9; set the attribute to compare). The
    conserved quantity is ``E + tr(p_g²)/2W + P̄0 V + W_dev + chains``
    (module docstring); ``W_dev``, the deviatoric target's work, is
    integrated exactly over each drift. A non-hydrostatic target (``P0``
    not a multiple of 1) is a constant true (Cauchy) stress: the dynamics
    and the conserved quantity are exact, but its work depends on the path,
    so only a hydrostatic target gives a Gibbs isothermal-isobaric ensemble
    (as in LAMMPS ``fix npt``).
    """

    name = "MTK anisotropic NPT"

    def __init__(
        self,
        timestep: float,
        temperature: float,
        pressure=1.0,
        tdamp: float | None = None,
        pdamp: float | None = None,
        tchain: int = 3,
        pchain: int = 3,
        tloop: int = 1,
        ploop: int = 1,
        mask=None,
    ) -> None:
        super().__init__(timestep, temperature, tdamp, pdamp, tchain, pchain, tloop, ploop)
        owner = type(self).__name__
        self.pressure, self.mask = target_pressure(owner, pressure), cell_mask(owner, mask)
        self._pressure, self._mask = pressure_tensor(self.pressure), _from_voigt(self.mask)
        self.cell_dof = sum(self.mask)
        """Degrees of freedom of the barostat's chain (free independent components of ``p_g``)."""
        self.p_g = torch.zeros(3, 3, dtype=torch.float64)
        self.deviatoric_work = 0.0

    @property
    def barostat_mass(self) -> float:
        """``W``, eV fs²."""
        return (self._dof + 3) * self._kt * self.pdamp**2 / 3.0

    @property
    def _mean_pressure(self) -> float:
        return float(torch.trace(self._pressure)) / 3.0

    def _cell_chain_dof(self) -> tuple[float, int]:
        return float(self.cell_dof), self.cell_dof

    def _start_cell(self, md: MDState) -> None:
        self.p_g = torch.zeros(3, 3, dtype=torch.float64)
        self.deviatoric_work = 0.0

    def _cell_two_ke(self) -> float:
        return float((self.p_g * self.p_g).sum()) / self.barostat_mass

    def _scale_cell_momentum(self, scale: float) -> None:
        self.p_g = self.p_g * scale

    def _kick_cell(self, md: MDState, delta: float) -> None:
        """``p_g += delta * mask ∘ (V (P_virial - P0) + sum m v⊗v + (2K/Nf) 1)``."""
        volume = self._volume(md)
        kinetic = kinetic_tensor(md)
        force = -volume * _host(md.stress) - volume * self._pressure + kinetic
        force = force + torch.trace(kinetic) / self._dof * torch.eye(3, dtype=torch.float64)
        self.p_g = self.p_g + delta * self._mask * force

    def _eigen(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenvalues and eigenvectors (columns) of ``p_g / W``."""
        rates, vectors = torch.linalg.eigh(self.p_g / self.barostat_mass)
        return rates, vectors

    def _kick_atoms(self, md: MDState, delta: float) -> None:
        """Forces and the cell's drag, integrated exactly over ``delta`` in the eigenbasis of ``p_g``."""
        rates, u = self._eigen()
        x = -delta * (rates + float(torch.trace(self.p_g)) / (self._dof * self.barostat_mass))
        u_md = u.to(md.velocities)
        v, a = md.velocities @ u_md, md.accelerations() @ u_md
        v = v * torch.exp(x).to(v) + delta * a * _exprel_tensor(x).to(v)
        md.velocities = v @ u_md.T

    def _drift(self, md: MDState, delta: float) -> None:
        """Positions and cell stretch by ``expm(delta p_g / W)``; then the new forces and stress."""
        rates, u = self._eigen()
        x = delta * rates
        u_md = u.to(md.positions)
        r, v = md.positions @ u_md, md.velocities @ u_md
        md.positions = (r * torch.exp(x).to(r) + delta * v * _exprel_tensor(x).to(r)) @ u_md.T
        volume = self._volume(md)
        strain = delta * self.p_g / self.barostat_mass
        deviatoric = self._pressure - self._mean_pressure * torch.eye(3, dtype=torch.float64)
        # Work of the deviatoric target over the drift: V grows as exp(t tr(strain)/delta), so its integral is exact.
        self.deviatoric_work += volume * _exprel(float(torch.trace(strain))) * float((deviatoric * strain).sum())
        cell = _host(md.sharded.cell)
        md.sharded.set_cell((cell @ u) * torch.exp(x) @ u.T)
        md.want_stress = True
        md.compute()

    def _cell_energy(self, md: MDState) -> float:
        return 0.5 * self._cell_two_ke() + self._mean_pressure * self._volume(md) + self.deviatoric_work

    def _cell_state(self) -> dict:
        return {"p_g": self.p_g.tolist(), "deviatoric_work": self.deviatoric_work}

    def _load_cell_state(self, state: dict, md: MDState) -> None:
        self.p_g = torch.tensor(state["p_g"], dtype=torch.float64)
        self.deviatoric_work = float(state["deviatoric_work"])

    def describe(self) -> str:
        return (
            f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, {_describe_pressure(self.pressure)}, "
            f"tdamp = {self.tdamp:g} fs, pdamp = {self.pdamp:g} fs, {_describe_mask(self.mask)}"
        )


_VOIGT_NAMES = ("xx", "yy", "zz", "yz", "xz", "xy")


def _describe_pressure(pressure: float | tuple[float, ...]) -> str:
    if isinstance(pressure, float):
        return f"P = {pressure:g} bar"
    return "P (xx yy zz yz xz xy) = (" + ", ".join(f"{p:g}" for p in pressure) + ") bar"


def _describe_mask(mask: tuple[bool, ...]) -> str:
    return "free cell components " + " ".join(n for n, free in zip(_VOIGT_NAMES, mask) if free)


class StochasticCellRescaling(Langevin):
    """NPT by isotropic stochastic cell rescaling (Bernetti & Bussi 2020) with a Langevin (BAOAB) thermostat.

    Parameters
    ----------
    timestep : fs.
    temperature : K.
    pressure : target pressure, bar.
    compressibility : isothermal compressibility estimate, 1/bar (default
        4.5e-5, water's; it scales the relaxation rate, not the averages).
    taup : barostat relaxation time, fs (default ``1000 * timestep``).
    friction : Langevin collision rate, 1/fs.
    seed : noise seed (the atoms' noise and the cell's, on separate streams).

    Each step, between the last drift and the force call, the log-volume moves
    by one Euler-Maruyama step of the module docstring's equation, with the
    internal pressure from the current kinetic energy and the latest stress;
    positions and cell scale by ``exp(d eps / 3)``, velocities by its inverse.
    The noise is one number per step keyed by ``(seed, step)``, the same on
    every rank. The ``conserved`` column is ``E + P0 V - heat`` (the
    thermostat's heat); it is not conserved here (the barostat's work is not
    accounted).
    """

    name = "stochastic cell rescaling NPT (Langevin)"

    def __init__(
        self,
        timestep: float,
        temperature: float,
        pressure: float = 1.0,
        compressibility: float = 4.5e-5,
        taup: float | None = None,
        friction: float = 0.01,
        seed: int = 0,
    ) -> None:
        super().__init__(timestep, temperature, friction, seed)
        taup = 1000.0 * self.timestep if taup is None else taup
        _check_positive(type(self).__name__, temperature=temperature, compressibility=compressibility, taup=taup)
        self.pressure = self._target(pressure)
        self.compressibility, self.taup = float(compressibility), float(taup)

    def _target(self, pressure) -> float:
        return _check_pressure(type(self).__name__, pressure)

    @property
    def _mean_pressure(self) -> float:
        """Mean target pressure, eV/Å³."""
        return self.pressure * BAR_TO_EV_PER_A3

    def setup(self, md: MDState, restarted: bool) -> None:
        if not md.can_stress:
            raise ValueError(f"{type(self).__name__}: constant pressure needs a cell periodic along all three axes")
        if md.stress is None:
            md.want_stress = True
            md.compute()

    def _before_forces(self, md: MDState) -> None:
        cell = md.sharded.cell.detach().to(torch.float64)
        volume = float(torch.linalg.det(cell).abs())
        kt = KB * self.temperature
        beta = self.compressibility / BAR_TO_EV_PER_A3  # Å³/eV
        internal = 2.0 * float(md.kinetic_energy()) / (3.0 * volume) - float(torch.trace(md.stress)) / 3.0
        drift = -(beta / self.taup) * (self.pressure * BAR_TO_EV_PER_A3 - internal - kt / volume) * self.timestep
        xi = float(gaussian(self.seed, md.step, torch.zeros(1, dtype=torch.int64), 1, stream=BAROSTAT)[0, 0])
        d_eps = drift + math.sqrt(2.0 * kt * beta * self.timestep / (volume * self.taup)) * xi
        scale = math.exp(d_eps / 3.0)
        md.positions = md.positions * scale
        md.velocities = md.velocities / scale
        md.sharded.set_cell(cell * scale)
        md.want_stress = True

    def extra_energy(self, md: MDState) -> float:
        volume = float(torch.linalg.det(md.sharded.cell.detach().to(torch.float64)).abs())
        return super().extra_energy(md) + self._mean_pressure * volume

    def describe(self) -> str:
        return (
            f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, P = {self.pressure:g} bar, "
            f"taup = {self.taup:g} fs, compressibility = {self.compressibility:g}/bar, friction = {self.friction:g}/fs, seed {self.seed}"
        )


class AnisotropicCellRescaling(StochasticCellRescaling):
    """NPT by fully flexible stochastic cell rescaling with a Langevin (BAOAB) thermostat, with a cell mask.

    Parameters
    ----------
    timestep, temperature, compressibility, taup, friction, seed : as
        :class:`StochasticCellRescaling`.
    pressure : target, bar: a number (hydrostatic), six Voigt components
        ``xx yy zz yz xz xy`` or a symmetric 3x3 matrix of the pressure
        tensor (positive: compressive), in the cell's standard frame.
    mask : free components of the cell's deformation in its standard frame,
        as :class:`MTKNPT`'s (``None``: all six; ``(1, 1, 1, 0, 0, 0)``:
        lengths only, LAMMPS ``aniso``; ``(0, 0, 1, 0, 0, 0)``: z only).

    Equations: the anisotropic stochastic cell rescaling of Del Tatto,
    Raiteri, Bernetti & Bussi, Appl. Sci. 12, 1139 (2022), the fully flexible
    form of Bernetti & Bussi 2020 (as in the authors' LAMMPS ``fix
    press/crescale tri``). In the cell's standard frame (``cell.T = Q h``:
    ``h`` upper triangular with a positive diagonal, lattice vectors its
    columns, ``a`` along x and ``b`` in the xy plane), each step changes ``h``
    by one Euler-Maruyama (Itô) step of

        ``dh = [-(beta / 3 tau_p) U(P0 - P_int - kT/V 1) dt + sqrt(2 kT beta / (3 V tau_p)) U(dW)] h``

    with ``U``: the upper triangle (diagonal included) of the masked
    components, ``P_int = (sum m v⊗v - V σ)/V`` the internal pressure tensor
    (kinetic plus virial) in that frame, ``dW`` six independent Wiener
    increments (one number each per step, keyed by ``(seed, step)``, the same
    on every rank). Positions map as ``x -> (1 + D) x`` and velocities as
    ``v -> (1 + D)^-1 v`` with ``D = dh h^-1``, upper triangular, so the cell
    never rotates. For a cell with only its diagonal free, the stationary
    distribution of these equations is ``exp[-(E + P0 V)/kT]``, flat in
    ``h_xx, h_yy, h_zz`` (the ``kT/V`` term is the Itô drift of the
    multiplicative noise: Fokker-Planck equation). Its volume noise equals
    the isotropic scheme's; the drifts differ at order ``kT/V`` (the
    isotropic scheme's ``kT/V`` acts on the log-volume), an ``O(1/N)``
    difference of conventions.
    """

    name = "anisotropic stochastic cell rescaling NPT (Langevin)"

    def __init__(
        self,
        timestep: float,
        temperature: float,
        pressure=1.0,
        compressibility: float = 4.5e-5,
        taup: float | None = None,
        friction: float = 0.01,
        seed: int = 0,
        mask=None,
    ) -> None:
        super().__init__(timestep, temperature, pressure, compressibility, taup, friction, seed)
        self.mask = cell_mask(type(self).__name__, mask)
        self._pressure, self._mask = pressure_tensor(self.pressure), torch.triu(_from_voigt(self.mask))

    def _target(self, pressure) -> float | tuple[float, ...]:
        return target_pressure(type(self).__name__, pressure)

    @property
    def _mean_pressure(self) -> float:
        return float(torch.trace(self._pressure)) / 3.0

    def _before_forces(self, md: MDState) -> None:
        cell = _host(md.sharded.cell)
        frame, h = _standard_frame(cell)
        volume = float(torch.linalg.det(h))
        kt = KB * self.temperature
        beta = self.compressibility / BAR_TO_EV_PER_A3  # Å³/eV
        internal = kinetic_tensor(md) / volume - _host(md.stress)
        excess = frame.T @ (self._pressure - internal) @ frame - kt / volume * torch.eye(3, dtype=torch.float64)
        noise = _from_voigt(gaussian(self.seed, md.step, torch.zeros(1, dtype=torch.int64), 6, stream=BAROSTAT)[0].tolist())
        rate = beta / (3.0 * self.taup)
        step = self._mask * (-rate * self.timestep * excess + math.sqrt(2.0 * kt * rate * self.timestep / volume) * noise)
        deform = torch.eye(3, dtype=torch.float64) + frame @ step @ frame.T  # 1 + D, in the lab frame (column vectors)
        forward = deform.T.to(md.positions)
        md.positions = md.positions @ forward
        md.velocities = md.velocities @ torch.linalg.inv(deform).T.to(md.velocities)
        md.sharded.set_cell(cell @ deform.T)
        md.want_stress = True

    def describe(self) -> str:
        return (
            f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, {_describe_pressure(self.pressure)}, "
            f"taup = {self.taup:g} fs, compressibility = {self.compressibility:g}/bar, friction = {self.friction:g}/fs, "
            f"seed {self.seed}, {_describe_mask(self.mask)}"
        )


def _standard_frame(cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, h)`` with ``cell.T = Q h``: Q a rotation (or reflection), h upper triangular with a positive diagonal."""
    q, r = torch.linalg.qr(cell.T)
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(r.dtype)
    return q * signs, signs[:, None] * r
