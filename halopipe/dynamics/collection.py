"""Python's cyclic garbage collector during an MD run: young collections on a schedule, no full one mid-run.

Left alone, CPython runs a full collection whenever enough objects have
survived the younger ones. With torch, Warp, ASE and the rest imported, a full
collection walks about 250,000 objects: 0.11 s on one AMD EPYC thread, as long
as eight Lennard-Jones steps of 32,000 atoms. In a run one fell every 20-40
steps, and on several ranks the rank that paused held the others at the next
collective (the demo composite of 8,000 atoms on 2 ranks lost 4.7-5.7 ms a
step to collections, a sixth of its step). The objects a step creates die
young, mostly freed by reference counting, so during :meth:`Simulation.run
<halopipe.dynamics.Simulation.run>` the automatic collector is off; every
:data:`YOUNG_EVERY` steps the run collects the young generations (cycles a
step leaves behind are freed within that many steps) and every
:data:`FULL_EVERY` steps everything. Every rank collects at the same steps, so
no rank waits for another's pause. The collector is switched back on when the
run returns or raises; a process that had it off keeps it off, uncollected.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

__all__ = ["scheduled_collection", "YOUNG_EVERY", "FULL_EVERY"]

YOUNG_EVERY = 100
"""Steps between collections of the young generations (0 and 1) during a run."""

FULL_EVERY = 5000
"""Steps between full collections during a run."""


@contextlib.contextmanager
def scheduled_collection() -> Iterator[Callable[[int], None]]:
    """Switch automatic collection off for a run; yields ``collect(step)``, to call after each step."""
    enabled = gc.isenabled()
    gc.disable()

    def collect(step: int) -> None:
        if not enabled:
            return
        if step % FULL_EVERY == 0:
            gc.collect()
        elif step % YOUNG_EVERY == 0:
            gc.collect(1)

    try:
        yield collect
    finally:
        if enabled:
            gc.enable()
