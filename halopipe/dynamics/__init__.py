"""Molecular dynamics on one process or many ranks: integrators, simulation, reporters.

The same code runs everywhere: a :class:`Simulation` scatters the system over
the ranks (one rank on a single process), integrators update the atoms each
rank owns and reduce global quantities across ranks, and random numbers are
keyed by global atom ids, so trajectories do not depend on the rank count.
"""

from .barostats import MTKNPT, AnisotropicCellRescaling, IsotropicMTKNPT, StochasticCellRescaling
from .integrators import FIRE, Integrator, Langevin, MDState, NoseHooverChain, VelocityVerlet
from .reporters import EnergyPlot, ProgressBar, Reporter, ThermoLog, Trajectory
from .simulation import CheckpointError, CheckpointMismatch, Simulation, load_checkpoint
from .velocities import degrees_of_freedom, maxwell_boltzmann

__all__ = [
    "Integrator",
    "MDState",
    "VelocityVerlet",
    "Langevin",
    "NoseHooverChain",
    "FIRE",
    "IsotropicMTKNPT",
    "StochasticCellRescaling",
    "MTKNPT",
    "AnisotropicCellRescaling",
    "Simulation",
    "load_checkpoint",
    "CheckpointError",
    "CheckpointMismatch",
    "Reporter",
    "ProgressBar",
    "ThermoLog",
    "Trajectory",
    "EnergyPlot",
    "maxwell_boltzmann",
    "degrees_of_freedom",
]
