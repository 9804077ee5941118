"""The single-process domain's plan: one band of ghost rows per halo width, each band a prefix of the ghost rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from halopipe import System
from halopipe.domain import LocalDomain

WIDTHS = (1.0, 2.5, 4.0)


def _system() -> System:
    """60 atoms in an irregular triclinic cell shorter than the widest halo, so the images span several cells."""
    cell = np.array([[6.0, 0.0, 0.0], [1.7, 5.4, 0.0], [-0.9, 1.3, 5.1]])
    positions = np.random.default_rng(3).uniform(0, 1, (60, 3)) @ cell
    return System(positions=torch.tensor(positions), numbers=torch.full((60,), 18), cell=torch.tensor(cell), pbc=torch.tensor([True] * 3))


def _images(domain: LocalDomain, n_ghost: int) -> set[tuple[int, ...]]:
    """The first ``n_ghost`` ghost rows as (owner, lattice shift) pairs."""
    owners, shifts = domain.ghost_atom[:n_ghost].tolist(), domain.ghost_shift[:n_ghost].tolist()
    return {(a, *s) for a, s in zip(owners, shifts)}


def test_each_band_is_the_plan_of_its_own_width_and_keeps_the_owners_order():
    """A plan nesting three widths: each width's prefix holds the ghosts of a plan for that width alone, no more."""
    system = _system()
    nested = LocalDomain(system, skin=0.5)
    nested.prepare(list(WIDTHS))
    assert nested.halo_bands == WIDTHS
    counts = [nested.ghost_count(w) for w in WIDTHS]
    assert 0 < counts[0] < counts[1] < counts[2] == nested.n_exchanged
    for width, count in zip(WIDTHS, counts):
        alone = LocalDomain(system, skin=0.5)
        alone.prepare(width)
        assert alone.ghost_count(width) == count
        assert _images(nested, count) == _images(alone, count)
    # within a band the rows keep their owners' order (no sort by distance): owner indices never decrease
    start = 0
    for count in counts:
        owners = nested.ghost_atom[start:count]
        assert bool((owners[1:] >= owners[:-1]).all())
        start = count


def test_a_width_the_plan_lacks_is_refused_and_preparing_it_adds_a_band():
    domain = LocalDomain(_system(), skin=0.5)
    assert domain.prepare(4.0)
    assert domain.ghost_count(6.0) == domain.ghost_count(4.0)  # past the widest band: all of it
    with pytest.raises(ValueError, match=r"no ghost rows planned for a halo of 2\.5 Å: the plan nests \[4\.0\] Å"):
        domain.ghost_count(2.5)
    assert not domain.prepare([4.0])  # nothing moved and the width is planned: the plan stays
    assert domain.prepare([2.5])  # a new band: a new plan, which keeps the wider one
    assert domain.halo_bands == (2.5, 4.0)
    assert 0 < domain.ghost_count(2.5) < domain.ghost_count(4.0)


def test_a_plan_needs_a_width():
    with pytest.raises(ValueError, match="at least one halo width"):
        LocalDomain(_system()).prepare([])
