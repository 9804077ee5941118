"""Helpers shared by the constant-pressure tests: a simulation's ASE twin and the conserved quantity's excursion."""

from __future__ import annotations

from ase import Atoms, units
from ase.calculators.lj import LennardJones as AseLennardJones

from halopipe import Pipeline, System
from halopipe.distributed import DomainConfig
from halopipe.dynamics import Integrator, Simulation

from ._workers import lj


def to_ase(sim: Simulation) -> Atoms:
    """The simulation's current state as ASE atoms with the same (unshifted, 6 Å) Lennard-Jones as :func:`lj`."""
    start = sim.system()
    atoms = Atoms(
        numbers=start.numbers.numpy(), positions=start.positions.numpy(), cell=start.cell.numpy(), pbc=True, masses=start.masses.numpy()
    )
    atoms.set_velocities(start.fields["velocities"].numpy() / units.fs)  # Å/fs -> Å per ASE time unit
    atoms.calc = AseLennardJones(sigma=3.4, epsilon=0.0104, rc=6.0, smooth=False)
    return atoms


def conserved_spread(system: System, integrator: Integrator, temperature: float, time_fs: float) -> float:
    """Largest minus smallest conserved quantity (eV), sampled every 10 steps over ``time_fs`` of LJ argon."""
    sim = Simulation(Pipeline([lj()], config=DomainConfig(skin=0.4)), system, integrator)
    sim.set_velocities(temperature, seed=5)
    sim.run(0)
    values = [sim.thermo()["conserved"]]
    for _ in range(int(time_fs / integrator.timestep / 10)):
        sim.run(10)
        values.append(sim.thermo()["conserved"])
    return max(values) - min(values)
