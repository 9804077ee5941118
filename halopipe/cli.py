"""The ``halopipe`` command line."""

from __future__ import annotations

import argparse
import sys

import torch

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import demo_pipeline, demo_system, directional_force_check, time_call

    if args.nproc > 1 or _under_launcher():
        from .distributed.demo import run_distributed_demo

        return run_distributed_demo(args.nproc, args.atoms, args.repeats)
    system = demo_system(cells=_cells(args.atoms))
    pipeline = demo_pipeline()
    print(f"halopipe demo: {system.n_atoms} atoms (NaCl melt-like box), 1 process, float64")
    first = time_call(lambda: pipeline(system, stress=True), 1)  # builds the ghost plan and neighbour lists
    out = pipeline(system, stress=True)
    seconds = time_call(lambda: pipeline(system, stress=True), args.repeats)  # plan and lists reused, as in MD within the skin
    models = [s.model for g in pipeline.groups for s in g.steps]
    names = [n for row in pipeline.names for n in row]
    print(f"{'model':<14}{'cutoff/Å':>10}{'energy/eV':>18}")
    for name, model in zip(names, models):
        print(f"{name:<14}{model.cutoff:>10.2f}{float(out['model_energies'][name]):>18.6f}")
    print(f"{'total':<14}{'':>10}{float(out['energy']):>18.6f}")
    p = -torch.trace(out["stress"]) / 3 * 160.21766208
    print(f"pressure: {float(p):.4f} GPa;  charges sum to {float(out['fields']['charges'].sum()):.2e} e")
    analytic, numeric = directional_force_check(pipeline, system)
    print(f"force check: -F.d = {analytic:.9f}, finite difference dE/dd = {numeric:.9f} (diff {abs(analytic - numeric):.2e} eV/Å)")
    print(f"time per evaluation (energy+forces+stress): {first * 1e3:.1f} ms building plan and lists, {seconds * 1e3:.1f} ms reusing them")
    return 0


def _cells(atoms: int) -> int:
    from .demo import cells_for_atoms

    return cells_for_atoms(atoms)


def _under_launcher() -> bool:
    from .distributed.launch import launched_by_runner

    return launched_by_runner()


def build_parser() -> argparse.ArgumentParser:
    from .dynamics.cli_commands import add_demo_parser, add_run_parser, add_verify_parser

    parser = argparse.ArgumentParser(prog="halopipe", description="Composed interatomic potentials under domain decomposition.")
    sub = parser.add_subparsers(dest="command", required=True)
    # `demo` is a short MD run; `demo --evaluate` is the single evaluation checked against one process (_cmd_demo).
    add_demo_parser(sub)
    add_run_parser(sub)
    add_verify_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
