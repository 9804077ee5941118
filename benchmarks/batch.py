"""Many small systems: one batched call against a Python loop of calls, side by side on one process.

Each case evaluates ``--systems`` rattled rock-salt NaCl cells of 64 atoms
(:func:`halopipe.demo.demo_system` with 2 cells per edge, a different seed
each; energy and forces, float64, one thread) three ways, interleaved
``--repeats`` times:

* ``loop``: one pipeline called on each system in turn, as a user's loop over
  structures does (each call plans the new system);
* ``loop, one pipeline each``: a pipeline per system, so each keeps its plan
  and lists between repeats (the best a loop can do on unchanged structures);
* ``batch``: ``pipeline(systems)`` on one pipeline (its plans kept between repeats).

Composites: ``demo`` (ChargeModel -> DSFCoulomb wired in an autograd group,
plus LennardJones direct) and ``lj-d3`` (LennardJones + DFT-D3(BJ, PBE) at
its default cutoffs). The median of each is reported, with the ratio to the
loop; the energies of the three are checked to agree.

    python benchmarks/batch.py --systems 64 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import print_table  # noqa: E402

from halopipe import DFTD3, Group, LennardJones, Pipeline, Step  # noqa: E402
from halopipe.demo import CL, NA, demo_pipeline, demo_system  # noqa: E402


def lj_d3() -> Pipeline:
    lj = LennardJones(epsilon={NA: 0.0115, CL: 0.0043}, sigma={NA: 2.0, CL: 3.4}, cutoff=8.0)
    return Pipeline([Group([Step(lj), Step(DFTD3("pbe"))], autograd=False)])


COMPOSITES = {"demo": demo_pipeline, "lj-d3": lj_d3}


def run_case(name: str, n_systems: int, repeats: int) -> list:
    systems = [demo_system(cells=2, seed=k) for k in range(n_systems)]
    factory = COMPOSITES[name]
    shared, each, batched = factory(), [factory() for _ in systems], factory()

    def loop():
        return torch.stack([shared(s)["energy"] for s in systems])

    def loop_each():
        return torch.stack([p(s)["energy"] for p, s in zip(each, systems)])

    def batch():
        return batched(systems)["energy"]

    ways = {"loop": loop, "loop, one pipeline each": loop_each, "batch": batch}
    energies = {way: fn() for way, fn in ways.items()}  # untimed: kernels load, plans are made
    spread = max(float((e - energies["loop"]).abs().max()) for e in energies.values())
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[way].append(time.perf_counter() - t0)
    loop_time = statistics.median(times["loop"])
    rows = []
    for way in ways:
        median = statistics.median(times[way])
        size = f"{n_systems} x {systems[0].n_atoms}"
        rows.append([name, size, way, f"{median * 1e3:.1f}", f"{median / loop_time:.2f}x", f"{spread:.1e}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--composites", nargs="+", default=sorted(COMPOSITES), choices=sorted(COMPOSITES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for name in args.composites for row in run_case(name, args.systems, args.repeats)]
    header = ["composite", "systems x atoms", "way", "median ms (E+F)", "vs loop", "max |dE| (eV)"]
    print_table(f"batch vs loop, 1 process, 1 thread, float64, median of {args.repeats}", header, rows)


if __name__ == "__main__":
    main()
