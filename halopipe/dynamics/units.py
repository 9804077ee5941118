"""Units of halopipe dynamics: eV, Å, amu, fs, K.

Forces over masses come out in eV/(Å·amu); one eV/(Å·amu) is
``ACCELERATION`` Å/fs². A kinetic energy ``m v² / 2`` with ``v`` in Å/fs and
``m`` in amu is in amu·Å²/fs², which is ``1 / ACCELERATION`` eV per unit.
The factor is ASE's ``units.fs ** 2`` (ASE's time unit is Å·sqrt(amu/eV)).
"""

from __future__ import annotations

__all__ = ["ACCELERATION", "KB", "EV_PER_A3_TO_GPA", "KINETIC"]

ACCELERATION = 0.009648533290731906
"""1 eV/(Å·amu) in Å/fs² (= ``ase.units.fs ** 2``)."""

KINETIC = 1.0 / ACCELERATION
"""1 amu·Å²/fs² in eV."""

KB = 8.617333262e-5
"""Boltzmann constant, eV/K (CODATA 2018)."""

EV_PER_A3_TO_GPA = 160.21766208
"""1 eV/Å³ in GPa."""
