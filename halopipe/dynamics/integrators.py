"""Integrators and a minimiser that run unchanged on one process or many ranks.

An integrator advances an :class:`MDState`: the atoms this rank owns (their
positions, velocities, masses, global ids), the forces on them, and a
``compute()`` call that evaluates the potential collectively. Per-atom updates
touch owned atoms only; every global quantity (kinetic energy, FIRE's power
``F . v``, the largest force) is a sum or maximum over ranks. Velocities live
in the sharded system's per-atom fields, so when ``compute()`` migrates atoms
between ranks (and re-sorts them) the velocities travel with them; that is
why integrators re-read ``md.velocities`` after every ``compute()``.

* :class:`VelocityVerlet` (NVE): kick-drift-force-kick, time reversible and
  symplectic; the total energy is conserved up to a bounded fluctuation.
* :class:`Langevin` (NVT): the BAOAB splitting of Leimkuhler & Matthews:
  half kick, half drift, an exact Ornstein-Uhlenbeck step of the velocities,
  half drift, force, half kick. The noise of atom ``i`` at step ``n`` is a
  counter-based hash of ``(seed, n, i)``, so trajectories are the same on any
  rank count and after a restart.
* :class:`NoseHooverChain` (NVT): velocity Verlet wrapped in half steps of a
  Nosé-Hoover chain (Martyna, Tuckerman & Klein 1996); deterministic and with a
  conserved extended energy.
* :class:`FIRE`: the fast inertial relaxation engine (Bitzek et al. 2006) for
  geometry optimisation, stopping on the largest atomic force.

Units: Å, fs, amu, eV, K (see :mod:`halopipe.dynamics.units`).
"""

from __future__ import annotations

import math

import torch

from .random import LANGEVIN, gaussian
from .units import ACCELERATION, KB, KINETIC
from .velocities import degrees_of_freedom

__all__ = ["MDState", "Integrator", "VelocityVerlet", "Langevin", "NoseHooverChain", "FIRE"]


class MDState:
    """The owned atoms of this rank, their forces, and the force call.

    Parameters
    ----------
    sharded : the :class:`~halopipe.distributed.ShardedSystem`; it must carry
        a ``velocities`` field of shape (N, 3) in Å/fs.
    potential : a :class:`~halopipe.Pipeline`.
    """

    def __init__(self, sharded, potential) -> None:
        if "velocities" not in sharded.fields:
            raise ValueError("MDState: the sharded system needs a 'velocities' field (N, 3); Simulation adds it")
        self.sharded, self.potential = sharded, potential
        self.step = 0
        self.time = 0.0
        self.want_stress = False
        self.want_energy = True
        self.can_stress = bool(sharded.pbc.all())
        self.forces: torch.Tensor | None = None
        self.energy: torch.Tensor | None = None
        self.stress: torch.Tensor | None = None
        self.result: dict = {}
        self._row_masses: tuple[torch.Tensor, torch.Tensor] | None = None

    # ----------------------------------------------------------- the atoms
    @property
    def positions(self) -> torch.Tensor:
        return self.sharded.positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self.sharded.positions = value

    @property
    def velocities(self) -> torch.Tensor:
        return self.sharded.fields["velocities"]

    @velocities.setter
    def velocities(self, value: torch.Tensor) -> None:
        self.sharded.fields["velocities"] = value

    @property
    def masses(self) -> torch.Tensor:
        return self.sharded.masses

    @property
    def row_masses(self) -> torch.Tensor:
        """The masses as an (N, 3) contiguous array, made again only when migration replaces :attr:`masses`.

        Dividing (N, 3) forces by it gives the same bits as by ``masses[:, None]``,
        in a third of the time on the CPU: torch's broadcast division is slow.
        """
        masses = self.masses
        if self._row_masses is None or self._row_masses[0] is not masses:
            self._row_masses = (masses, masses[:, None].expand(-1, 3).contiguous())
        return self._row_masses[1]

    @property
    def ids(self) -> torch.Tensor:
        return self.sharded.ids

    @property
    def n_total(self) -> int:
        return int(self.sharded.n_total)

    # -------------------------------------------------------- global sums
    def reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max/min) over ranks; collective."""
        return self.sharded.all_reduce(x, op)

    def kinetic_energy(self) -> torch.Tensor:
        """Global kinetic energy, eV (collective)."""
        return self.reduce(self.local_kinetic().reshape(1)).reshape(())

    def local_kinetic(self) -> torch.Tensor:
        """This rank's share of the kinetic energy, eV."""
        return 0.5 * (self.masses[:, None] * self.velocities.square()).sum() * KINETIC

    # ------------------------------------------------------------- forces
    def compute(self) -> None:
        """Evaluate the potential (collective); atoms may migrate and re-sort here.

        The energy is evaluated when :attr:`want_energy` (else :attr:`energy`
        is None), the stress when :attr:`want_stress` and the cell is periodic.
        """
        out = self.potential(self.sharded, stress=self.want_stress and self.can_stress, energy=self.want_energy)
        self.result = out
        self.forces = out["forces"].detach()
        self.energy = out["energy"].detach() if self.want_energy else None
        self.stress = out["stress"].detach() if "stress" in out else None

    def accelerations(self) -> torch.Tensor:
        """Forces over masses in Å/fs², rows matching the current owned atoms."""
        return self.forces / self.row_masses * ACCELERATION


class Integrator:
    """Base class. Subclasses implement :meth:`step` and, if they carry state, the state methods.

    Parameters
    ----------
    timestep : fs.
    """

    name = "integrator"
    momentum_conserved = True
    converged = False
    energy_every_step = False
    """Whether a step needs the potential energy (a minimiser that may stop at any step sets it, so its last energy is known)."""

    def __init__(self, timestep: float) -> None:
        if not (isinstance(timestep, (int, float)) and math.isfinite(timestep) and timestep > 0):
            raise ValueError(f"{type(self).__name__}: timestep must be a positive number of fs, got {timestep!r}")
        self.timestep = float(timestep)

    def dof(self, n_total: int) -> int:
        """Degrees of freedom for the temperature."""
        return degrees_of_freedom(n_total, self.momentum_conserved)

    def setup(self, md: MDState, restarted: bool) -> None:
        """Called once, after the first force evaluation."""

    def step(self, md: MDState) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def extra_energy(self, md: MDState) -> float:
        """Energy to add to potential + kinetic for the conserved quantity (collective)."""
        return 0.0

    def state_dict(self, md: MDState) -> dict:
        """Global state for a checkpoint (collective; the same on every rank)."""
        return {}

    def load_state_dict(self, state: dict, md: MDState) -> None:
        """Restore :meth:`state_dict` (``md`` is this rank's state)."""

    def describe(self) -> str:
        return f"{self.name}, dt = {self.timestep:g} fs"


def _check_positive(owner: str, **values) -> None:
    for key, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{owner}: {key} must be a positive number, got {value!r}")


def _verlet_step(md: MDState, dt: float) -> None:
    """Kick (dt/2), drift (dt), new forces, kick (dt/2): the velocity-Verlet core shared by NVE and Nosé-Hoover.

    Each update is one fused torch operation (``v + c f / m``, ``x + dt v``):
    on tens of thousands of atoms the step's glue is a pass per operation.
    """
    kick = 0.5 * dt * ACCELERATION
    md.velocities = torch.addcdiv(md.velocities, md.forces, md.row_masses, value=kick)
    md.positions = torch.add(md.positions, md.velocities, alpha=dt)
    md.compute()
    md.velocities = torch.addcdiv(md.velocities, md.forces, md.row_masses, value=kick)


class VelocityVerlet(Integrator):
    """Velocity Verlet (NVE).

    Parameters
    ----------
    timestep : fs.
    """

    name = "velocity Verlet (NVE)"

    def step(self, md: MDState) -> None:
        _verlet_step(md, self.timestep)


class Langevin(Integrator):
    """Langevin dynamics (NVT) with the BAOAB splitting.

    Parameters
    ----------
    timestep : fs.
    temperature : K.
    friction : collision rate gamma, 1/fs (e.g. 0.01 for a 100 fs relaxation time).
    seed : noise seed; the noise of atom ``i`` at step ``n`` is keyed by
        ``(seed, n, i)``.

    The conserved quantity reported is ``E_total - heat``, where ``heat`` is the
    kinetic energy the thermostat added so far; it should drift little.
    """

    name = "Langevin BAOAB (NVT)"
    momentum_conserved = False

    def __init__(self, timestep: float, temperature: float, friction: float = 0.01, seed: int = 0) -> None:
        super().__init__(timestep)
        _check_positive("Langevin", friction=friction)
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ValueError(f"Langevin: temperature must be >= 0 K, got {temperature!r}")
        self.temperature, self.friction, self.seed = float(temperature), float(friction), int(seed)
        self._heat_local = 0.0  # this rank's share: summed over ranks only when reported

    def step(self, md: MDState) -> None:
        dt, half = self.timestep, 0.5 * self.timestep
        v = md.velocities + half * md.accelerations()
        x = md.positions + half * v
        c1 = math.exp(-self.friction * dt)
        sigma = torch.sqrt(KB * self.temperature / (md.masses * KINETIC))[:, None]
        noise = gaussian(self.seed, md.step, md.ids, 3, stream=LANGEVIN, dtype=v.dtype)
        before = md.masses[:, None] * v.square()
        v = c1 * v + math.sqrt(1.0 - c1 * c1) * sigma * noise
        # Kept as a tensor: no device sync per step; summed over ranks only when reported.
        self._heat_local = self._heat_local + 0.5 * KINETIC * (md.masses[:, None] * v.square() - before).sum()
        md.velocities = v
        md.positions = x + half * v
        self._before_forces(md)
        md.compute()
        md.velocities = md.velocities + half * md.accelerations()

    def _before_forces(self, md: MDState) -> None:
        """Hook between the last drift and the force call (a barostat rescales the cell here)."""

    def heat(self, md: MDState) -> float:
        """Kinetic energy added by the thermostat since the start, eV (collective)."""
        local = torch.as_tensor(self._heat_local, dtype=torch.float64, device=md.positions.device).reshape(1)
        return float(md.reduce(local)[0])

    def extra_energy(self, md: MDState) -> float:
        return -self.heat(md)

    def state_dict(self, md: MDState) -> dict:
        return {"seed": self.seed, "heat": self.heat(md)}

    def load_state_dict(self, state: dict, md: MDState) -> None:
        self.seed = int(state["seed"])
        self._heat_local = float(state["heat"]) if md.sharded.rank == 0 else 0.0

    def describe(self) -> str:
        return f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, friction = {self.friction:g}/fs, seed {self.seed}"


class NoseHooverChain(Integrator):
    """Nosé-Hoover chain thermostat (NVT) around velocity Verlet.

    Parameters
    ----------
    timestep : fs.
    temperature : K.
    tdamp : thermostat time constant, fs (default ``100 * timestep``).
    chain : number of thermostats in the chain.
    substeps : thermostat substeps per half step.

    The masses are ``Q_1 = dof kB T tdamp²`` and ``Q_j = kB T tdamp²``. The
    conserved extended energy is ``E + sum_j Q_j v_j² / 2 + dof kB T eta_1 +
    kB T sum_{j>1} eta_j``.
    """

    name = "Nosé-Hoover chain (NVT)"

    def __init__(self, timestep: float, temperature: float, tdamp: float | None = None, chain: int = 3, substeps: int = 1) -> None:
        super().__init__(timestep)
        tdamp = 100.0 * self.timestep if tdamp is None else tdamp
        _check_positive("NoseHooverChain", temperature=temperature, tdamp=tdamp)
        if not (isinstance(chain, int) and chain >= 1) or not (isinstance(substeps, int) and substeps >= 1):
            raise ValueError(f"NoseHooverChain: chain and substeps must be integers >= 1, got chain={chain!r}, substeps={substeps!r}")
        self.temperature, self.tdamp, self.chain, self.substeps = float(temperature), float(tdamp), chain, substeps
        self.eta = [0.0] * chain
        self.v_eta = [0.0] * chain

    def _masses(self, dof: int) -> list[float]:
        kt = KB * self.temperature
        return [max(dof, 1) * kt * self.tdamp**2] + [kt * self.tdamp**2] * (self.chain - 1)

    def _force(self, j: int, two_ke: float, q: list[float], dof: int) -> float:
        kt = KB * self.temperature
        if j == 0:
            return (two_ke - dof * kt) / q[0]
        return (q[j - 1] * self.v_eta[j - 1] ** 2 - kt) / q[j]

    def _half_chain(self, md: MDState) -> None:
        """Propagate the chain by dt/2 and scale the velocities (one global sum)."""
        dof = self.dof(md.n_total)
        q = self._masses(dof)
        two_ke = 2.0 * float(md.kinetic_energy())
        m, v = self.chain, self.v_eta
        scale = 1.0
        h = 0.5 * self.timestep / self.substeps
        for _ in range(self.substeps):
            v[m - 1] += 0.5 * h * self._force(m - 1, two_ke, q, dof)
            for j in range(m - 2, -1, -1):
                e = math.exp(-0.25 * h * v[j + 1])
                v[j] = (v[j] * e + 0.5 * h * self._force(j, two_ke, q, dof)) * e
            s = math.exp(-h * v[0])
            scale *= s
            two_ke *= s * s
            for j in range(m):
                self.eta[j] += h * v[j]
            for j in range(m - 1):
                e = math.exp(-0.25 * h * v[j + 1])
                v[j] = (v[j] * e + 0.5 * h * self._force(j, two_ke, q, dof)) * e
            v[m - 1] += 0.5 * h * self._force(m - 1, two_ke, q, dof)
        md.velocities = md.velocities * scale

    def step(self, md: MDState) -> None:
        self._half_chain(md)
        _verlet_step(md, self.timestep)
        self._half_chain(md)

    def extra_energy(self, md: MDState) -> float:
        dof = self.dof(md.n_total)
        q = self._masses(dof)
        kt = KB * self.temperature
        kinetic = sum(0.5 * qj * vj * vj for qj, vj in zip(q, self.v_eta))
        return kinetic + dof * kt * self.eta[0] + kt * sum(self.eta[1:])

    def state_dict(self, md: MDState) -> dict:
        return {"eta": list(self.eta), "v_eta": list(self.v_eta)}

    def load_state_dict(self, state: dict, md: MDState) -> None:
        if len(state["eta"]) != self.chain:
            raise ValueError(
                f"NoseHooverChain: the checkpoint has a chain of {len(state['eta'])} thermostats, this integrator {self.chain}"
            )
        self.eta, self.v_eta = [float(x) for x in state["eta"]], [float(x) for x in state["v_eta"]]

    def describe(self) -> str:
        return f"{self.name}, dt = {self.timestep:g} fs, T = {self.temperature:g} K, tdamp = {self.tdamp:g} fs, chain {self.chain}"


class FIRE(Integrator):
    """FIRE geometry optimisation (Bitzek et al., PRL 97, 170201, 2006).

    Parameters
    ----------
    timestep : initial time step, fs.
    max_timestep : largest time step, fs (default ``10 * timestep``).
    fmax : converged when the largest atomic force is below this, eV/Å.
    max_step : largest displacement of any atom in one step, Å.
    n_min, f_inc, f_dec, alpha_start, f_alpha : the usual FIRE constants.

    Masses enter as in MD (``a = F / m``). The step count limit is the number
    of steps given to ``Simulation.run``; :attr:`converged` stops it early.
    """

    name = "FIRE (minimisation)"
    momentum_conserved = False
    energy_every_step = True

    def __init__(
        self,
        timestep: float = 1.0,
        max_timestep: float | None = None,
        fmax: float = 0.05,
        max_step: float = 0.2,
        n_min: int = 5,
        f_inc: float = 1.1,
        f_dec: float = 0.5,
        alpha_start: float = 0.1,
        f_alpha: float = 0.99,
    ) -> None:
        super().__init__(timestep)
        max_timestep = 10.0 * self.timestep if max_timestep is None else max_timestep
        _check_positive(
            "FIRE",
            max_timestep=max_timestep,
            fmax=fmax,
            max_step=max_step,
            f_inc=f_inc,
            f_dec=f_dec,
            alpha_start=alpha_start,
            f_alpha=f_alpha,
        )
        if not (isinstance(n_min, int) and n_min >= 0):
            raise ValueError(f"FIRE: n_min must be an integer >= 0, got {n_min!r}")
        self.max_timestep, self.fmax, self.max_step = float(max_timestep), float(fmax), float(max_step)
        self.n_min, self.f_inc, self.f_dec = n_min, float(f_inc), float(f_dec)
        self.alpha_start, self.f_alpha = float(alpha_start), float(f_alpha)
        self.dt, self.alpha, self.n_positive = self.timestep, self.alpha_start, 0
        self.converged = False
        self.max_force = math.inf

    def setup(self, md: MDState, restarted: bool) -> None:
        if not restarted:
            md.velocities = torch.zeros_like(md.velocities)
        self._check(md)

    def _check(self, md: MDState) -> None:
        local = md.forces.norm(dim=1).max() if md.forces.shape[0] else md.forces.new_zeros(())
        self.max_force = float(md.reduce(local.reshape(1), "max")[0])
        self.converged = self.max_force < self.fmax

    def step(self, md: MDState) -> None:
        f, v = md.forces, md.velocities
        sums = md.reduce(torch.stack([(f * v).sum(), f.square().sum(), v.square().sum()]))
        power, f_norm, v_norm = float(sums[0]), math.sqrt(float(sums[1])), math.sqrt(float(sums[2]))
        if power > 0:
            if f_norm > 0:
                v = (1.0 - self.alpha) * v + self.alpha * (v_norm / f_norm) * f
            if self.n_positive > self.n_min:
                self.dt = min(self.dt * self.f_inc, self.max_timestep)
                self.alpha *= self.f_alpha
            self.n_positive += 1
        else:
            v = torch.zeros_like(v)
            self.dt *= self.f_dec
            self.alpha = self.alpha_start
            self.n_positive = 0
        v = v + self.dt * md.accelerations()
        dx = self.dt * v
        local = dx.norm(dim=1).max() if dx.shape[0] else dx.new_zeros(())
        largest = float(md.reduce(local.reshape(1), "max")[0])
        if largest > self.max_step:
            dx = dx * (self.max_step / largest)
        md.velocities = v
        md.positions = md.positions + dx
        md.compute()
        self._check(md)

    def state_dict(self, md: MDState) -> dict:
        return {"dt": self.dt, "alpha": self.alpha, "n_positive": self.n_positive}

    def load_state_dict(self, state: dict, md: MDState) -> None:
        self.dt, self.alpha, self.n_positive = float(state["dt"]), float(state["alpha"]), int(state["n_positive"])

    def describe(self) -> str:
        return f"{self.name}, dt0 = {self.timestep:g} fs, fmax = {self.fmax:g} eV/Å"
