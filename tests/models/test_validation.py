"""Bad parameters are rejected at construction with a message naming the model (or DomainConfig) and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from halopipe import DFTD3, PME, ChargeModel, DSFCoulomb, Ewald, LennardJones, TorchModel
from halopipe.distributed import DomainConfig, ShardedSystem

from ..conftest import triclinic_nacl

LENGTHS = {
    "LennardJones": lambda c: LennardJones(cutoff=c),
    "DSFCoulomb": lambda c: DSFCoulomb(cutoff=c),
    "ChargeModel": lambda c: ChargeModel(cutoff=c),
    "DFTD3": lambda c: DFTD3(cutoff=c),
    "DFTD3 cn": lambda c: DFTD3(cn_cutoff=c),
    "DFTD3 atm": lambda c: DFTD3(atm_cutoff=c, s9=1.0),
    "Ewald": lambda c: Ewald(cutoff=c),
    "PME": lambda c: PME(cutoff=c),
    "PME mesh": lambda c: PME(cutoff=5.0, mesh_spacing=c),
    "TorchModel": lambda c: TorchModel(__import__("torch").nn.Identity(), cutoff=c),
}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -1.0, "far"])
@pytest.mark.parametrize("model", sorted(LENGTHS))
def test_bad_lengths_are_rejected_naming_model_and_value(model, value):
    name = model.split()[0]
    with pytest.raises(ValueError, match=rf"^{name}: \w+ must be a (finite )?positive number of Å, got {value!r}"):
        LENGTHS[model](value)


def test_mace_r_max_is_checked():
    pytest.importorskip("mace")
    from halopipe import MACE

    from .test_mace import build_model

    module = build_model("scaleshift_L2_corr3")
    module.r_max.fill_(math.nan)
    with pytest.raises(ValueError, match=r"^MACE: the model's r_max must be a finite positive number of Å"):
        MACE(module)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: DSFCoulomb(alpha=math.nan), r"DSFCoulomb: alpha must be a finite number >= 0"),
        (lambda: ChargeModel(total_charge=math.inf), r"ChargeModel: total_charge must be a finite number"),
        (lambda: DFTD3(s9=math.nan), r"DFTD3: s9 must be a finite number"),
        (lambda: LennardJones(epsilon=math.nan), r"LennardJones: need finite epsilon"),
        (lambda: LennardJones(sigma={11: 2.0, 17: math.inf}), r"LennardJones: need finite epsilon >= 0 and sigma > 0"),
        (lambda: Ewald(alpha=math.inf), r"Ewald: alpha must be a finite positive number"),
        (lambda: Ewald(kmax=math.inf), r"Ewald: kmax must be a finite positive number"),
    ],
)
def test_other_non_finite_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"timeout": math.inf}, r"DomainConfig.timeout must be a finite number of seconds > 0, got inf"),
        ({"timeout": math.nan}, r"DomainConfig.timeout must be a finite number of seconds > 0, got nan"),
        ({"timeout": 0}, r"DomainConfig.timeout"),
        ({"skin": math.nan}, r"DomainConfig.skin must be a finite number >= 0 \(Å\), got nan"),
        ({"grid": (2.0, 1, 1)}, r"DomainConfig.grid must be three positive integers, got \(2.0, 1, 1\)"),
        ({"grid": (True, 1, 1)}, r"DomainConfig.grid must be three positive integers"),
        ({"grid": (1, 1)}, r"DomainConfig.grid must be three positive integers"),
        ({"grid": (0, 1, 1)}, r"DomainConfig.grid must be three positive integers"),
    ],
)
def test_domain_config_problems(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DomainConfig(**kwargs)  # rejected at construction, before any rank starts


def test_grid_that_does_not_fit_the_world_size():
    config = DomainConfig(grid=(1, 1, 2))
    assert "has 2 bricks but the world size is 1" in config.problem(1)
    with pytest.raises(ValueError, match=r"has 2 bricks but the world size is 1"):
        ShardedSystem.scatter(triclinic_nacl(), config)


@pytest.mark.parametrize("grid", [np.array([1, 1, 1]), (np.int64(1), np.int32(1), 1)])
def test_numpy_integer_grids_are_accepted_as_ints(grid):
    config = DomainConfig(grid=grid, skin=np.float64(0.5))
    sharded = ShardedSystem.scatter(triclinic_nacl(), config)
    assert config.grid == (1, 1, 1) and all(type(g) is int for g in config.grid)
    assert tuple(sharded.grid) == (1, 1, 1)
