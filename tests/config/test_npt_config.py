"""The ``npt_mtk`` and ``npt_csr`` integrator sections: coupling, cell mask and pressure tensor; bad values name their key."""

from __future__ import annotations

import pytest

from halopipe.config import ConfigError, parse_config
from halopipe.dynamics import MTKNPT, AnisotropicCellRescaling, IsotropicMTKNPT, StochasticCellRescaling


def _data(kind: str = "npt_mtk", **integrator) -> dict:
    return {
        "system": {"generator": {"type": "argon", "cells": 2}},
        "models": {"lj": {"type": "LennardJones", "epsilon": 0.0104, "sigma": 3.4, "cutoff": 6.0}},
        "integrator": {"type": kind, "timestep": 2.0, "temperature": 90.0, "pressure": 1.0, **integrator},
        "steps": 10,
    }


@pytest.mark.parametrize(
    "kind, coupling, expected",
    [
        ("npt_mtk", None, IsotropicMTKNPT),
        ("npt_mtk", "isotropic", IsotropicMTKNPT),
        ("npt_mtk", "anisotropic", MTKNPT),
        ("npt_mtk", "triclinic", MTKNPT),
        ("npt_csr", None, StochasticCellRescaling),
        ("npt_csr", "anisotropic", AnisotropicCellRescaling),
        ("npt_csr", "triclinic", AnisotropicCellRescaling),
    ],
)
def test_coupling_chooses_the_barostat(kind, coupling, expected):
    extra = {} if coupling is None else {"coupling": coupling}
    built = parse_config(_data(kind, **extra)).build_integrator()
    assert type(built) is expected
    if coupling == "anisotropic":
        assert built.mask == (True, True, True, False, False, False), "anisotropic: lengths free, no shear"
    if coupling == "triclinic":
        assert built.mask == (True,) * 6


def test_mask_and_pressure_tensor_in_either_form():
    voigt = _data(coupling="triclinic", mask=[False, False, True, False, False, False], pressure=[1.0, 1.0, 500.0, 0.0, 0.0, 0.0])
    matrix = _data(
        coupling="triclinic",
        mask=[[False, False, False], [False, False, False], [False, False, True]],
        pressure=[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 500]],
    )
    a, b = (parse_config(d).build_integrator() for d in (voigt, matrix))
    assert a.mask == b.mask == (False, False, True, False, False, False)
    assert a.pressure == b.pressure == (1.0, 1.0, 500.0, 0.0, 0.0, 0.0)
    assert a.cell_dof == 1


@pytest.mark.parametrize(
    "change, key",
    [
        ({"coupling": "tri"}, "integrator.coupling"),
        ({"mask": [True] * 6}, "integrator.mask"),  # a mask needs anisotropic or triclinic coupling
        ({"pressure": [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]}, "integrator.pressure"),  # so does a pressure tensor
        ({"coupling": "anisotropic", "mask": [True] * 6}, "integrator.mask"),  # anisotropic has no shear
        ({"coupling": "triclinic", "mask": [True, True]}, "integrator.mask"),
        ({"coupling": "triclinic", "mask": [1, 0, 1, 0, 0, 0]}, "integrator.mask"),
        ({"coupling": "triclinic", "mask": [False] * 6}, "integrator.mask"),
        ({"coupling": "triclinic", "mask": [[True, True, False], [False, True, False], [False, False, True]]}, "integrator.mask"),
        ({"coupling": "triclinic", "pressure": [1.0, 2.0]}, "integrator.pressure"),
        ({"coupling": "triclinic", "pressure": [[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]}, "integrator.pressure"),
        ({"coupling": "triclinic", "pressure": [1.0, 1.0, float("nan"), 0.0, 0.0, 0.0]}, "integrator.pressure"),
        ({"coupling": "triclinic", "pressure": True}, "integrator.pressure"),
        ({"coupling": "triclinic", "pdamp": -1.0}, "integrator.pdamp"),
    ],
)
@pytest.mark.parametrize("kind", ["npt_mtk", "npt_csr"])
def test_bad_values_name_their_key(kind, change, key):
    if kind == "npt_csr" and "pdamp" in change:
        change = {"coupling": "triclinic", "taup": -1.0}
        key = "integrator.taup"
    with pytest.raises(ConfigError) as info:
        parse_config(_data(kind, **change), base=".")
    assert info.value.key == key, str(info.value)
