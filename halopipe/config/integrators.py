"""Integrator types of the ``integrator:`` section: one spec per integrator, chosen by ``type``.

Fields are the integrator's constructor parameters; an unset one takes the integrator's own default.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from .errors import ConfigError
from .fields import Count, Int, NonNegative, Positive, PositiveInt, Section, tagged_union, type_names

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


def _checked(check):
    """A before-validator running a barostat's own check, its ValueError becoming a ConfigError at this key."""

    def validate(value):
        from ..dynamics import barostats

        try:
            return check(barostats, value)
        except ValueError as exc:
            raise ConfigError("", str(exc).split(": ", 1)[-1]) from exc

    return BeforeValidator(validate)


def _pressure(barostats, value):
    target = barostats.target_pressure("pressure", value)
    return target if isinstance(target, float) else list(target)


PressureValue = Annotated[float | list[float], _checked(_pressure)]
"""A number of bar, or a pressure tensor: six Voigt components or a symmetric 3x3 matrix (stored in Voigt form)."""
MaskValue = Annotated[list[bool], _checked(lambda barostats, value: list(barostats.cell_mask("mask", value)))]
"""Six Voigt booleans or a symmetric 3x3 boolean matrix (stored in Voigt form)."""

_PRESSURE_HELP = (
    "target pressure, bar (1 bar = 1e-4 GPa): a number (hydrostatic) or, with coupling anisotropic or triclinic, a pressure "
    "tensor (positive compresses; the negative of ASE's stress) as six Voigt components [xx, yy, zz, yz, xz, xy] or a 3x3 matrix"
)
_COUPLING_HELP = (
    "isotropic (default): the volume changes, the shape is kept; anisotropic: the three Cartesian lengths change independently, "
    "no shear (LAMMPS aniso); triclinic: all six components of the cell (LAMMPS tri), restricted by mask"
)
_MASK_HELP = (
    "which cell components may change, six booleans [xx, yy, zz, yz, xz, xy] or a 3x3 matrix (true: free); "
    "default: xx yy zz for anisotropic, all for triclinic; e.g. [false, false, true, false, false, false]: only z"
)
_NO_SHEAR = [True, True, True, False, False, False]


class _BarostatSpec(IntegratorSpec):
    """An NPT integrator with an isotropic class and an anisotropic one, chosen by ``coupling``."""

    anisotropic_class_name: ClassVar[str]
    selectors: ClassVar[tuple[str, ...]] = ("coupling",)
    """Fields that choose the class instead of being passed to it."""

    @model_validator(mode="after")
    def _coupling_allows(self):
        if self.coupling in (None, "isotropic"):
            if self.mask is not None:
                raise ConfigError("mask", "a cell mask needs coupling: anisotropic or triclinic (isotropic changes the volume only)")
            if isinstance(self.pressure, list):
                raise ConfigError("pressure", "a pressure tensor needs coupling: anisotropic or triclinic; give one number for isotropic")
        if self.coupling == "anisotropic" and self.mask is not None and any(self.mask[3:]):
            raise ConfigError("mask", "anisotropic coupling keeps the shear (yz, xz, xy) fixed; use coupling: triclinic to free it")
        return self

    def build(self):
        from .. import dynamics

        values = self.model_dump(exclude={"type", *self.selectors}, exclude_none=True)
        if self.coupling in (None, "isotropic"):
            return integrator_class(self.type)(**values)
        if self.coupling == "anisotropic":
            values.setdefault("mask", _NO_SHEAR)
        return getattr(dynamics, self.anisotropic_class_name)(**values)


class IsotropicMTKNPTSpec(_BarostatSpec):
    """NPT with MTK barostat and Nosé-Hoover chains: isotropic, anisotropic or triclinic cell fluctuations."""

    class_name: ClassVar[str] = "IsotropicMTKNPT"
    anisotropic_class_name: ClassVar[str] = "MTKNPT"
    type: Literal["npt_mtk"]
    timestep: Positive = Field(description="fs")
    temperature: Positive = Field(description="K")
    pressure: PressureValue = Field(description=_PRESSURE_HELP)
    coupling: Literal["isotropic", "anisotropic", "triclinic"] | None = Field(None, description=_COUPLING_HELP)
    mask: MaskValue | None = Field(None, description=_MASK_HELP)
    tdamp: Positive | None = Field(None, description="thermostat time constant, fs (default 100 timesteps)")
    pdamp: Positive | None = Field(None, description="barostat time constant, fs (default 1000 timesteps)")
    tchain: PositiveInt | None = Field(None, description="thermostats in the atoms' chain")
    pchain: PositiveInt | None = Field(None, description="thermostats in the barostat's chain")
    tloop: PositiveInt | None = Field(None, description="atoms' chain substeps per half step")
    ploop: PositiveInt | None = Field(None, description="barostat's chain substeps per half step")


class StochasticCellRescalingSpec(_BarostatSpec):
    """NPT by stochastic cell rescaling (Bernetti & Bussi 2020) with a Langevin thermostat: isotropic, anisotropic or triclinic."""

    class_name: ClassVar[str] = "StochasticCellRescaling"
    anisotropic_class_name: ClassVar[str] = "AnisotropicCellRescaling"
    type: Literal["npt_csr"]
    timestep: Positive = Field(description="fs")
    temperature: Positive = Field(description="K")
    pressure: PressureValue = Field(description=_PRESSURE_HELP)
    coupling: Literal["isotropic", "anisotropic", "triclinic"] | None = Field(None, description=_COUPLING_HELP)
    mask: MaskValue | None = Field(None, description=_MASK_HELP + " (in the cell's standard frame: a along x, b in the xy plane)")
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
