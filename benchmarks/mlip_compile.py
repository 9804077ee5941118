"""Compiled and checkpointed MLIPs (+ D3) against their reference calculators (+ s-dftd3), side by side.

Every row is one fresh process (one per rank), so each peak RSS is its own:
the reference calculator alone and with s-dftd3 summed, then halopipe's model
eager, ``compile=True``, ``checkpoint=True`` (and, with ``--variants``, both),
alone and in one autograd group with DFT-D3(PBE, BJ). Rows run in turn and the whole list ``--rounds``
times (interleaved); the table keeps each row's best time. Energy + forces +
stress per evaluation, one thread per process.

* ``--model 7net-0``: pretrained SevenNet-0 (the ``[sevenn]`` extra, its own
  environment) in float32 on rattled diamond Si, D3 at its default cutoffs
  (50.2 / 21.2 Å), as sevenn's ``SevenNetCalculator`` + s-dftd3;
* ``--model mace``: a random-weight MACE of realistic size (128x0e+128x1o,
  max_ell 3, correlation 3, 2 layers, r_max 5 Å) in float64 on an amorphous
  H/C/O box, D3 at 15 / 10 Å, as mace-torch's ``MACECalculator`` + s-dftd3.

Memory is reported as peak RSS and as the growth of RSS over the process's
RSS before its first evaluation (model, structure and imports excluded), per
atom, and as the growth during one warm evaluation (after the first: the peak
RSS is reset through ``/proc/self/clear_refs``, so one-time costs such as
TorchScript's first-call optimisation drop out; what an MD step needs). A
compiled row's time excludes its first (compiling) evaluation, which is
reported apart.

    OMP_NUM_THREADS=1 python benchmarks/mlip_compile.py --model 7net-0 --atoms 512 --nproc 1 2
    OMP_NUM_THREADS=1 python benchmarks/mlip_compile.py --model mace --atoms 343
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table, rank, timed  # noqa: E402
from mlip_halo import D3_CN_CUTOFF, D3_CUTOFF, amorphous, build_mace, calculator_case, peak_rss_gb  # noqa: E402

VARIANTS = ["eager", "compiled", "checkpoint", "compiled+checkpoint"]  # halopipe's rows: compile and/or checkpoint


def current_rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def warm_growth_gb(evaluate) -> float:
    """RSS growth of one call of ``evaluate``: its peak (the kernel's VmHWM, reset first) over the RSS before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = current_rss_gb()
    evaluate()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1e6  # kB
    return peak - before


def silicon(n_atoms: int):
    """Rattled diamond Si (cubic cells, 8 atoms each) with about ``n_atoms`` atoms."""
    from ase.build import bulk

    n = max(1, round((n_atoms / 8) ** (1 / 3)))
    atoms = bulk("Si", "diamond", a=5.43, cubic=True).repeat(n)
    atoms.rattle(0.05, seed=0)
    return atoms


def structure(model: str, n_atoms: int):
    return silicon(n_atoms) if model == "7net-0" else amorphous(n_atoms)


def d3_cutoffs(model: str) -> tuple[float, float]:
    from halopipe.models.dftd3 import DEFAULT_CN_CUTOFF, DEFAULT_CUTOFF

    return (DEFAULT_CUTOFF, DEFAULT_CN_CUTOFF) if model == "7net-0" else (D3_CUTOFF, D3_CN_CUTOFF)


def halopipe_mlip(model: str, variant: str):
    from halopipe import MACE, SevenNet

    options = {"compile": "compiled" in variant, "checkpoint": "checkpoint" in variant}
    if model == "7net-0":
        return SevenNet("7net-0", dtype="float32", **options)
    return MACE(build_mace(), **options)


def halopipe_row(model: str, n_atoms: int, variant: str, with_d3: bool, repeats: int) -> dict:
    """halopipe's model (+ D3 in the same autograd group) on the launched ranks."""
    from halopipe import DFTD3, DomainConfig, Group, Pipeline, Step, System
    from halopipe.distributed import ShardedSystem

    torch.set_num_threads(1)
    steps = [Step(halopipe_mlip(model, variant))]
    if with_d3:
        cutoff, cn_cutoff = d3_cutoffs(model)
        steps.append(Step(DFTD3("pbe", cutoff=cutoff, cn_cutoff=cn_cutoff)))
    pipeline = Pipeline([Group(steps)], config=DomainConfig(skin=0.5, timeout=3600))
    system = System.from_ase(structure(model, n_atoms)) if rank() == 0 else None
    sharded = ShardedSystem.scatter(system, pipeline.config)
    before = current_rss_gb()
    first, _ = timed(lambda: pipeline(sharded, stress=True), 1)
    seconds, out = timed(lambda: pipeline(sharded, stress=True), repeats)
    growth = peak_rss_gb() - before
    warm = warm_growth_gb(lambda: pipeline(sharded, stress=True))
    rss, growth, warm, seconds, first = max_over_ranks([peak_rss_gb(), growth, warm, seconds, first])
    return {
        "seconds": seconds,
        "first": first,
        "rss": rss,
        "growth": growth,
        "warm": warm,
        "energy": float(out["energy"]),
        "n": sharded.n_total,
        "compilations": pipeline.compilations,
    }


def reference_row(model: str, n_atoms: int, with_d3: bool, repeats: int) -> dict:
    """The reference calculator (+ s-dftd3, summed) in one process."""
    torch.set_num_threads(1)
    if model == "7net-0":
        from sevenn.calculator import SevenNetCalculator

        calc = SevenNetCalculator("7net-0", device="cpu")
    else:
        from mace.calculators import MACECalculator

        calc = MACECalculator(models=build_mace(), default_dtype="float64", device="cpu")
    atoms = structure(model, n_atoms)
    before = current_rss_gb()
    cutoffs = d3_cutoffs(model) if with_d3 else (None, None)
    r = calculator_case(atoms, calc, repeats, *cutoffs)
    growth = peak_rss_gb() - before
    warm = warm_growth_gb(lambda: calculator_case(atoms, calc, 0, *cutoffs))
    return {**r, "first": float("nan"), "growth": growth, "warm": warm, "compilations": 0}


def main() -> None:
    from halopipe.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["7net-0", "mace"], default="7net-0")
    parser.add_argument("--atoms", type=int, default=512)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1], help="rank counts of the halopipe + D3 rows")
    parser.add_argument("--variants", nargs="+", default=VARIANTS[:3], choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=2, help="timed evaluations per process (after the first)")
    parser.add_argument("--rounds", type=int, default=2, help="times the whole list of rows runs (interleaved)")
    parser.add_argument("--no-alone", dest="alone", action="store_false", help="skip the rows without D3")
    args = parser.parse_args()

    reference = "SevenNetCalculator" if args.model == "7net-0" else "MACECalculator"
    rows: list[tuple[str, int, bool, object, tuple]] = []  # (label, ranks, with D3, function, arguments)
    for with_d3 in [False, True] if args.alone else [True]:
        suffix = " + s-dftd3" if with_d3 else ""
        rows.append((f"{reference}{suffix}", 1, with_d3, reference_row, (args.model, args.atoms, with_d3, args.repeats)))
        for variant in args.variants:
            for nproc in args.nproc if with_d3 else [1]:
                label = f"halopipe {variant}{' + D3' if with_d3 else ''}"
                rows.append((label, nproc, with_d3, halopipe_row, (args.model, args.atoms, variant, with_d3, args.repeats)))

    best: dict[tuple[str, int], dict] = {}
    for round_ in range(args.rounds):
        for label, nproc, _, function, arguments in rows:
            r = spawn(function, nproc, *arguments, timeout=7200)[0]
            key = (label, nproc)
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = r
            print(f"round {round_ + 1}: {label} on {nproc} rank(s): {r['seconds']:.3f} s, {r['rss']:.2f} GB", flush=True)

    table = []
    for label, nproc, with_d3, _, _ in rows:
        r = best[(label, nproc)]
        peer = best[(f"{reference}{' + s-dftd3' if with_d3 else ''}", 1)]
        table.append(
            [
                label,
                nproc,
                r["n"],
                f"{r['seconds']:.3f}",
                f"**{r['seconds'] / peer['seconds']:.2f}**",
                "-" if np.isnan(r["first"]) else f"{r['first']:.1f}",
                r["compilations"],
                f"{r['rss']:.2f}",
                f"{1e3 * r['growth'] * nproc / r['n']:.2f}",  # the largest rank's growth per atom it owns
                f"{1e3 * r['warm'] * nproc / r['n']:.2f}",
                f"{r['energy']:.4f}",
            ]
        )
    print_table(
        f"{args.model}, {args.atoms} atoms, E+F+stress, 1 thread per process, best of {args.rounds} rounds x {args.repeats}",
        [
            "row",
            "ranks",
            "atoms",
            "s / evaluation",
            "vs reference",
            "first evaluation / s",
            "graphs compiled",
            "peak RSS / GB (max rank)",
            "RSS growth / MB per owned atom (max rank)",
            "warm evaluation's RSS growth / MB per owned atom",
            "energy / eV",
        ],
        table,
    )


if __name__ == "__main__":
    main()
