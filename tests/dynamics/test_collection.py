"""The garbage collector during a run: off, young generations on a schedule, full ones rarely, restored afterwards."""

from __future__ import annotations

import gc

import pytest

from halopipe.dynamics import Simulation, VelocityVerlet
from halopipe.dynamics.collection import FULL_EVERY, YOUNG_EVERY, scheduled_collection
from halopipe.dynamics.reporters import Reporter

from ._workers import argon, lj


@pytest.fixture
def collections():
    """The generations CPython's collector ran, as it reports them to ``gc.callbacks``."""
    seen: list[int] = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def test_collections_follow_the_schedule_and_the_collector_comes_back(collections):
    assert gc.isenabled()
    with scheduled_collection() as collect:
        assert not gc.isenabled()
        collect(YOUNG_EVERY + 1)
        assert collections == []
        collect(3 * YOUNG_EVERY)
        assert collections == [1]  # the young generations only
        collect(2 * FULL_EVERY)
        assert collections == [1, 2]  # everything
    assert gc.isenabled()


def test_an_error_in_the_run_still_brings_the_collector_back():
    with pytest.raises(RuntimeError), scheduled_collection():
        raise RuntimeError("a failing step")
    assert gc.isenabled()


def test_a_process_with_the_collector_off_keeps_it_off_and_uncollected(collections):
    gc.disable()
    try:
        with scheduled_collection() as collect:
            collect(FULL_EVERY)
        assert not gc.isenabled() and collections == []
    finally:
        gc.enable()


class _CollectorState(Reporter):
    """Records whether the automatic collector is on at each step."""

    def __init__(self) -> None:
        super().__init__(every=1)
        self.enabled: list[bool] = []

    def report(self, sim, thermo) -> None:
        self.enabled.append(gc.isenabled())


def test_a_simulation_runs_its_steps_with_the_automatic_collector_off():
    state = _CollectorState()
    sim = Simulation(lj(), argon(cells=2), VelocityVerlet(2.0), reporters=[state])
    sim.run(3)
    assert state.enabled[0] is True  # the report of the starting state, before the steps
    assert state.enabled[1:] == [False, False, False]
    assert gc.isenabled()
