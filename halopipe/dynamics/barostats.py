"""Constant pressure: the isotropic Martyna-Tobias-Klein (MTK) barostat and stochastic cell rescaling.

In NPT the cell is a dynamical variable. The MTK equations (Martyna, Tobias &
Klein, J. Chem. Phys. 101, 4177 (1994); the integrator of Martyna, Tuckerman,
Tobias & Klein, Mol. Phys. 87, 1117 (1996)) give the log-volume strain
``eps`` (``cell = cell0 * exp(eps)``, the same factor on all three lattice
vectors) a momentum ``p_eps`` with mass ``W``, driven by the difference
between the instantaneous pressure (virial plus kinetic) and the target. The
atoms and the barostat each couple to a Nosé-Hoover chain, so the ensemble is
isothermal-isobaric and the extended energy

    H' = E_pot + E_kin + p_eps² / (2W) + P0 V + (both chains' energies)

is conserved; its drift is the integrator's health check.

Under domain decomposition nothing here is per rank beyond a scaling of the
owned atoms' positions and velocities: every barostat variable is a global
scalar computed from global sums (kinetic energy, stress), so all ranks take
the same step. The cell goes to the sharded system with
:meth:`~halopipe.distributed.ShardedSystem.set_cell`; bricks are fractional,
so they follow it, and the halo plan is rebuilt when the strain plus the
atoms' motion exceeds the skin (see :func:`~halopipe.domain.strain_displacement`).

The splitting and the masses follow ASE's ``IsotropicMTKNPT`` (whose
formulation is that of the 1996 paper), so the two integrate the same
trajectory; the one difference is the number of degrees of freedom ``Nf``:
halopipe uses ``3N - 3`` (the total momentum is conserved and zero), ASE
``3N``.

:class:`StochasticCellRescaling` (Bernetti & Bussi, J. Chem. Phys. 153,
114107 (2020)) is a first-order stochastic barostat: the log-volume follows
``d eps = -(beta/tau_p) (P0 - P_int - kT/V) dt + sqrt(2 kT beta / (V tau_p)) dW``
(``beta``: an estimate of the compressibility, which sets only the relaxation
speed). It relaxes fast without ringing and samples NPT, with a Langevin
thermostat here; it has no conserved quantity of the MTK kind.

Units: fs, K, eV, Å; the target pressure is in bar.
"""

from __future__ import annotations

import math

import torch
from ase import units

from .integrators import Integrator, Langevin, MDState, _check_positive
from .random import BAROSTAT, gaussian
from .units import KB

__all__ = ["IsotropicMTKNPT", "StochasticCellRescaling", "BAR_TO_EV_PER_A3"]

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


class IsotropicMTKNPT(Integrator):
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
        super().__init__(timestep)
        tdamp = 100.0 * self.timestep if tdamp is None else tdamp
        pdamp = 1000.0 * self.timestep if pdamp is None else pdamp
        _check_positive(type(self).__name__, temperature=temperature, tdamp=tdamp, pdamp=pdamp)
        _check_chain(type(self).__name__, tchain=tchain, pchain=pchain, tloop=tloop, ploop=ploop)
        if not (isinstance(pressure, (int, float)) and not isinstance(pressure, bool) and math.isfinite(pressure)):
            raise ValueError(f"{type(self).__name__}: pressure must be a finite number of bar, got {pressure!r}")
        self.temperature, self.pressure, self.tdamp, self.pdamp = float(temperature), float(pressure), float(tdamp), float(pdamp)
        self.tchain, self.pchain, self.tloop, self.ploop = tchain, pchain, tloop, ploop
        self.eps = 0.0
        self.p_eps = 0.0
        self.cell0: torch.Tensor | None = None
        self._atoms_chain: NoseHooverChainVariables | None = None
        self._cell_chain: NoseHooverChainVariables | None = None
        self._dof = 0

    # ------------------------------------------------------------ setup
    @property
    def _kt(self) -> float:
        return KB * self.temperature

    @property
    def barostat_mass(self) -> float:
        """``W``, eV fs²."""
        return (self._dof + 3) * self._kt * self.pdamp**2

    def _chains(self, dof: int) -> None:
        kt, tq, pq = self._kt, self._kt * self.tdamp**2, self._kt * self.pdamp**2
        self._dof = dof
        self._atoms_chain = NoseHooverChainVariables([dof * tq] + [tq] * (self.tchain - 1), kt, dof)
        self._cell_chain = NoseHooverChainVariables([9.0 * pq] + [pq] * (self.pchain - 1), kt, 1)

    def setup(self, md: MDState, restarted: bool) -> None:
        if not md.can_stress:
            raise ValueError(f"{type(self).__name__}: constant pressure needs a cell periodic along all three axes")
        if self._atoms_chain is None:
            self._chains(self.dof(md.n_total))
        if not restarted:
            self.cell0 = md.sharded.cell.detach().to(torch.float64).clone()
            self.eps = self.p_eps = 0.0
            self._chains(self.dof(md.n_total))
        if md.stress is None:  # the first force call of a run evaluates the stress only if a reporter asked
            md.want_stress = True
            md.compute()

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
        self.p_eps *= self._cell_chain.propagate(self.p_eps**2 / self.barostat_mass, delta, self.ploop)
        scale = self._atoms_chain.propagate(2.0 * float(md.kinetic_energy()), delta, self.tloop)
        md.velocities = md.velocities * scale

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

    # -------------------------------------------------------- reporting
    def extra_energy(self, md: MDState) -> float:
        volume = self._volume(md)
        return (
            self._atoms_chain.energy()
            + self._cell_chain.energy()
            + 0.5 * self.p_eps**2 / self.barostat_mass
            + self.pressure * BAR_TO_EV_PER_A3 * volume
        )

    def state_dict(self, md: MDState) -> dict:
        return {
            "eps": self.eps,
            "p_eps": self.p_eps,
            "cell0": self.cell0.cpu().tolist(),
            "thermostat": self._atoms_chain.state_dict(),
            "barostat": self._cell_chain.state_dict(),
        }

    def load_state_dict(self, state: dict, md: MDState) -> None:
        self._chains(self.dof(md.n_total))
        self._atoms_chain.load_state_dict(state["thermostat"], f"{type(self).__name__} thermostat")
        self._cell_chain.load_state_dict(state["barostat"], f"{type(self).__name__} barostat")
        self.eps, self.p_eps = float(state["eps"]), float(state["p_eps"])
        self.cell0 = torch.tensor(state["cell0"], dtype=torch.float64, device=md.sharded.cell.device)

    def describe(self) -> str:
        return (
            f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, P = {self.pressure:g} bar, "
            f"tdamp = {self.tdamp:g} fs, pdamp = {self.pdamp:g} fs"
        )


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
        if not (isinstance(pressure, (int, float)) and not isinstance(pressure, bool) and math.isfinite(pressure)):
            raise ValueError(f"{type(self).__name__}: pressure must be a finite number of bar, got {pressure!r}")
        self.pressure, self.compressibility, self.taup = float(pressure), float(compressibility), float(taup)

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
        return super().extra_energy(md) + self.pressure * BAR_TO_EV_PER_A3 * volume

    def describe(self) -> str:
        return (
            f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, P = {self.pressure:g} bar, "
            f"taup = {self.taup:g} fs, compressibility = {self.compressibility:g}/bar, friction = {self.friction:g}/fs, seed {self.seed}"
        )
