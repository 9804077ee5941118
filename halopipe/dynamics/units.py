"""Units of halopipe dynamics: eV, Å, amu, fs, K.

Forces over masses come out in eV/(Å·amu); one eV/(Å·amu) is
``ACCELERATION`` Å/fs². A kinetic energy ``m v² / 2`` with ``v`` in Å/fs and
``m`` in amu is in amu·Å²/fs², which is ``1 / ACCELERATION`` eV per unit.
Every constant comes from :mod:`ase.units` (ASE's time unit is
Å·sqrt(amu/eV)), so halopipe and ASE agree on temperatures and pressures.
"""

from __future__ import annotations

from ase import units

__all__ = ["ACCELERATION", "KB", "EV_PER_A3_TO_GPA", "KINETIC", "AMU_PER_A3_TO_G_PER_CM3"]

ACCELERATION = units.fs**2
"""1 eV/(Å·amu) in Å/fs²."""

KINETIC = 1.0 / ACCELERATION
"""1 amu·Å²/fs² in eV."""

KB = units.kB
"""Boltzmann constant, eV/K."""

EV_PER_A3_TO_GPA = 1.0 / units.GPa
"""1 eV/Å³ in GPa."""

AMU_PER_A3_TO_G_PER_CM3 = units._amu * 1e3 / 1e-24
"""1 amu/Å³ in g/cm³ (a density)."""
