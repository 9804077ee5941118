"""Integrator types of the ``integrator:`` section: one spec per integrator, chosen by ``type``.

Fields are the integrator's constructor parameters; an unset one takes the integrator's own default.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .errors import ConfigError
from .fields import Count, Int, NonNegative, Number, Positive, PositiveInt, Section, tagged_union, type_names

__all__ = ["INTEGRATOR_SPECS", "INTEGRATOR_TYPES", "IntegratorEntry", "integrator_class"]


class IntegratorSpec(Section):
    class_name: ClassVar[str]
    """Name of the class in :mod:`halopipe.dynamics`."""

    def build(self):
        return integrator_class(self.type)(**self.model_dump(exclude={"type"}, exclude_none=True))


class VelocityVerletSpec(IntegratorSpec):
    """NVE."""

    class_name: ClassVar[str] = "VelocityVerlet"
    type: Literal["velocity_verlet", "nve"]
    timestep: Positive = Field(description="fs")


class LangevinSpec(IntegratorSpec):
    """NVT with a Langevin thermostat."""

    class_name: ClassVar[str] = "Langevin"
    type: Literal["langevin"]
    timestep: Positive = Field(description="fs")
    temperature: NonNegative = Field(description="K")
    friction: Positive | None = Field(None, description="collision rate, 1/fs")
    seed: Int | None = Field(None, description="noise seed")


class NoseHooverChainSpec(IntegratorSpec):
    """NVT with a Nosé-Hoover chain."""

    class_name: ClassVar[str] = "NoseHooverChain"
    type: Literal["nose_hoover_chain", "nhc"]
    timestep: Positive = Field(description="fs")
    temperature: NonNegative = Field(description="K")
    tdamp: Positive | None = Field(None, description="thermostat time constant, fs (default 100 timesteps)")
    chain: PositiveInt | None = Field(None, description="thermostats in the chain")
    substeps: PositiveInt | None = Field(None, description="thermostat substeps per half step")


class IsotropicMTKNPTSpec(IntegratorSpec):
    """NPT with isotropic cell fluctuations: MTK barostat with Nosé-Hoover chains."""

    class_name: ClassVar[str] = "IsotropicMTKNPT"
    type: Literal["npt_mtk"]
    timestep: Positive = Field(description="fs")
    temperature: Positive = Field(description="K")
    pressure: Number = Field(description="target pressure, bar (1 bar = 1e-4 GPa)")
    tdamp: Positive | None = Field(None, description="thermostat time constant, fs (default 100 timesteps)")
    pdamp: Positive | None = Field(None, description="barostat time constant, fs (default 1000 timesteps)")
    tchain: PositiveInt | None = Field(None, description="thermostats in the atoms' chain")
    pchain: PositiveInt | None = Field(None, description="thermostats in the barostat's chain")
    tloop: PositiveInt | None = Field(None, description="atoms' chain substeps per half step")
    ploop: PositiveInt | None = Field(None, description="barostat's chain substeps per half step")


class StochasticCellRescalingSpec(IntegratorSpec):
    """NPT by stochastic cell rescaling (Bernetti & Bussi 2020) with a Langevin thermostat."""

    class_name: ClassVar[str] = "StochasticCellRescaling"
    type: Literal["npt_csr"]
    timestep: Positive = Field(description="fs")
    temperature: Positive = Field(description="K")
    pressure: Number = Field(description="target pressure, bar (1 bar = 1e-4 GPa)")
    compressibility: Positive | None = Field(None, description="compressibility estimate, 1/bar (default 4.5e-5)")
    taup: Positive | None = Field(None, description="barostat relaxation time, fs (default 1000 timesteps)")
    friction: Positive | None = Field(None, description="Langevin collision rate, 1/fs")
    seed: Int | None = Field(None, description="noise seed")


class FIRESpec(IntegratorSpec):
    """FIRE energy minimisation."""

    class_name: ClassVar[str] = "FIRE"
    type: Literal["fire"]
    timestep: Positive | None = Field(None, description="initial time step, fs")
    max_timestep: Positive | None = Field(None, description="largest time step, fs (default 10 timesteps)")
    fmax: Positive | None = Field(None, description="converged below this largest force, eV/Å")
    max_step: Positive | None = Field(None, description="largest displacement in one step, Å")
    n_min: Count | None = None
    f_inc: Positive | None = None
    f_dec: Positive | None = None
    alpha_start: Positive | None = None
    f_alpha: Positive | None = None


INTEGRATOR_SPECS = (VelocityVerletSpec, LangevinSpec, NoseHooverChainSpec, IsotropicMTKNPTSpec, StochasticCellRescalingSpec, FIRESpec)

INTEGRATOR_TYPES: dict[str, str] = {name: spec.class_name for spec in INTEGRATOR_SPECS for name in type_names(spec)}
"""Integrator names accepted in ``integrator.type`` and their classes."""

IntegratorEntry = tagged_union(INTEGRATOR_SPECS, "integrator")


def integrator_class(kind: str, key: str = "integrator.type"):
    """The integrator class for a ``type`` name."""
    from .. import dynamics

    if kind not in INTEGRATOR_TYPES:
        raise ConfigError(key, f"unknown integrator {kind!r}; choose one of {', '.join(INTEGRATOR_TYPES)}")
    return getattr(dynamics, INTEGRATOR_TYPES[kind])
