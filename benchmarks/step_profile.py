"""Where an MD step's time goes: neighbour search, rebuild, kernels, backward, communication and the rest.

Runs velocity-Verlet NVE on a case of ``md_throughput.py`` (LJ argon 32,000
atoms, the demo composite 8,000 atoms) and attributes the wall time of the
timed steps, per rank, to exclusive categories by wrapping a few functions:

* ``neighbour search``: ``PairLists.candidates`` (cell-list searches, the
  one-holder lists and their holder keys, and the filtering of narrower
  lists, their kernels included), once per rebuild;
* ``rebuild: partition, plan, migration``: ``ShardedSystem._repartition``
  (its communication included);
* ``kernels``: every Warp launch and every ``torch.fft`` transform;
* ``autograd backward``: ``torch.autograd.grad``, less the kernels and
  communication inside it;
* ``communication``: every ``Comm`` operation outside a rebuild, waiting for
  the slowest peer included (so on several ranks it also holds load imbalance),
  and what the halo does with a message in shared memory where it lies
  (placing refreshed rows, adding folded ones: ``Comm.exchange``'s consumer);
* ``other (Python, torch glue)``: the rest of the step (views, integrator,
  reductions' packing, checks).

    OMP_NUM_THREADS=1 python benchmarks/step_profile.py --cases lj-argon-32k --nproc 1 2 --steps 50
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from md_throughput import CASES, build, time_step  # noqa: E402

from halopipe import keep_freed_memory  # noqa: E402
from halopipe.distributed.launch import spawn  # noqa: E402

CATEGORIES = (
    "neighbour search",
    "rebuild: partition, plan, migration",
    "kernels",
    "autograd backward",
    "communication",
    "other (Python, torch glue)",
)


class StepProfile:
    """Exclusive wall time per category of wrapped functions (a category's time excludes wrapped calls inside it).

    A category made with ``absorb=True`` keeps everything nested in it (a
    search's kernels count as search).
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [category, time of wrapped children, absorbs]

    def wrap(self, fn, category: str, absorb: bool = False):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._stack and self._stack[-1][2]:
                return fn(*args, **kwargs)
            entry = [category, 0.0, absorb]
            self._stack.append(entry)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                self._stack.pop()
                self.totals[category] += spent - entry[1]
                if self._stack:
                    self._stack[-1][1] += spent

        return timed

    def install(self) -> None:
        """Wrap the functions behind each category (in this process)."""
        import warp

        from halopipe.distributed.comm import Comm
        from halopipe.distributed.sharded import ShardedSystem
        from halopipe.neighbors import PairLists

        PairLists.candidates = self.wrap(PairLists.candidates, CATEGORIES[0], absorb=True)
        ShardedSystem._repartition = self.wrap(ShardedSystem._repartition, CATEGORIES[1], absorb=True)
        warp.launch = self.wrap(warp.launch, CATEGORIES[2])
        for name in ("fftn", "ifftn", "rfftn", "irfftn", "fft", "ifft", "rfft", "irfft"):
            setattr(torch.fft, name, self.wrap(getattr(torch.fft, name), CATEGORIES[2]))
        torch.autograd.grad = self.wrap(torch.autograd.grad, CATEGORIES[3])
        Comm._run = self.wrap(Comm._run, CATEGORIES[4])
        Comm._run_shm = self.wrap(Comm._run_shm, CATEGORIES[4])  # the shared-memory path of ranks on one host


def worker(case: str, steps: int, warmup: int) -> dict:
    """One rank: warm up, then profile ``steps`` NVE steps (every rank calls this)."""
    from halopipe.dynamics import Simulation, VelocityVerlet

    torch.set_num_threads(1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    pipeline, system = build(case, "cpu")
    sim = Simulation(pipeline, system if rank == 0 else None, VelocityVerlet(time_step(case)))
    sim.set_velocities(300.0, seed=1)
    sim.run(warmup)
    profile = StepProfile()
    profile.install()
    rebuilds = sim.sharded.rebuilds
    gc.collect()  # no full collection owed from the set-up falls in the timed window
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    sim.run(steps)
    wall = time.perf_counter() - t0
    parts = {name: 1e3 * profile.totals.get(name, 0.0) / steps for name in CATEGORIES[:-1]}
    parts[CATEGORIES[-1]] = 1e3 * wall / steps - sum(parts.values())
    return {"rank": rank, "ms_per_step": 1e3 * wall / steps, "parts": parts, "rebuilds": sim.sharded.rebuilds - rebuilds}


def measure(case: str, nproc: int, steps: int, warmup: int) -> list[dict]:
    if nproc == 1:
        keep_freed_memory()  # as `halopipe run` and the launcher's ranks do
        return [worker(case, steps, warmup)]
    return spawn(worker, nproc, case, steps, warmup, timeout=3600, threads=1)


def _rebuild_in_steps(row: dict, steps: int) -> str:
    """One rebuild's search and repartition time over a plain step's time (the step's time without them)."""
    if not row["rebuilds"]:
        return "-"
    rebuild = sum(row["parts"][name] for name in CATEGORIES[:2])  # ms per step, over all steps
    plain = row["ms_per_step"] - rebuild
    return f"{rebuild * steps / row['rebuilds'] / plain:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=20, help="profiled steps (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    args = parser.parse_args(argv)
    print("| case | ranks | rank | ms/step | rebuilds | " + " | ".join(CATEGORIES) + " | a rebuild, in plain steps |")
    print("|---|---|---|---|---|" + "---|" * (len(CATEGORIES) + 1))
    for case in args.cases:
        for nproc in args.nproc:
            for r in measure(case, nproc, args.steps, args.warmup):
                cells = " | ".join(f"{r['parts'][name]:.1f}" for name in CATEGORIES)
                head = f"| {case} | {nproc} | {r['rank']} | {r['ms_per_step']:.1f} | {r['rebuilds']}"
                print(f"{head} | {cells} | {_rebuild_in_steps(r, args.steps)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
