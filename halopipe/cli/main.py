"""The ``halopipe`` parser and entry point.

Only the standard library is imported here: ``halopipe --help`` and
``--version`` answer without importing torch. Each command imports its module
(:mod:`~halopipe.cli.run`, :mod:`~halopipe.cli.demo`) when it runs. A failure
is printed as one line naming the failing rank (``--debug`` adds the
traceback); bad input (configuration, files, a busy run directory, a changed
restart) exits with status 2, other failures with 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

from .. import __version__
from ..allocator import keep_freed_memory
from .report import failure_message, note

__all__ = ["main", "build_parser"]

_BAD_INPUT = ("ConfigError", "FileNotFoundError", "CheckpointError", "CheckpointMismatch", "RunDirectoryBusy", "NotAConfiguration")
_STRUCTURE_SUFFIXES = {".xyz", ".extxyz", ".cif", ".pdb", ".vasp", ".poscar", ".traj", ".lammps", ".data", ".gro", ".mol", ".sdf"}
_STRUCTURE_NAMES = ("POSCAR", "CONTCAR", "OUTCAR", "vasprun")


class NotAConfiguration(ValueError):
    """A structure file given where a YAML configuration is expected."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _steps(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _check_not_structure(path: str) -> None:
    """Name a structure file passed as the configuration, before YAML parses (and an error prints) its contents."""
    from pathlib import Path

    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in _STRUCTURE_SUFFIXES or (suffix not in (".yaml", ".yml") and p.name.startswith(_STRUCTURE_NAMES)):
        raise NotAConfiguration(
            f"{path} looks like a structure file, not a YAML configuration; write a configuration that names it "
            f"(system: {{file: {p.name}}}) and pass that (see examples/)"
        )


def _load(path: str, steps: int | None = None):
    _check_not_structure(path)
    note(f"reading {path}")
    from ..config import load_config

    config = load_config(path)
    return config.with_steps(steps) if steps is not None else config


# ------------------------------------------------------------------ commands
def cmd_run(args: argparse.Namespace) -> int:
    """``halopipe run config.yaml [--nproc N] [--restart [--allow-changed]] [--output DIR] [--steps N]``."""
    config = _load(args.config, args.steps)
    from .run import run_config

    return run_config(config, nproc=args.nproc, restart=args.restart, output=args.output, allow_changed=args.allow_changed)


def cmd_verify(args: argparse.Namespace) -> int:
    """``halopipe verify config.yaml [--nproc N]``."""
    config = _load(args.config)
    from .run import verify_config

    return verify_config(config, nproc=args.nproc)


def cmd_demo(args: argparse.Namespace) -> int:
    """``halopipe demo``: a short MD run; ``--evaluate``: one evaluation checked against one process."""
    note("loading halopipe")
    from .demo import evaluate_demo, run_demo
    from .run import check_cores

    check_cores("halopipe demo", args.nproc)
    if args.evaluate:
        return evaluate_demo(args.nproc, args.atoms, args.repeats)
    return run_demo(nproc=args.nproc, atoms=args.atoms, steps=args.steps, output=args.output)


def cmd_relax(args: argparse.Namespace) -> int:
    """``halopipe relax structures.extxyz -o relaxed.extxyz --config pipeline.yaml [--fmax F] [--steps N] [--cell]``."""
    note("loading halopipe")
    from .relax import RelaxSettings, relax_file

    settings = RelaxSettings(fmax=args.fmax, steps=args.steps, cell=args.cell, pressure=args.pressure, batch=args.batch)
    return relax_file(args.structures, args.output, args.config, settings, stop_on_error=args.stop_on_error)


def cmd_schema(args: argparse.Namespace) -> int:
    """``halopipe schema``: the JSON schema of configuration files, for editors."""
    from ..config import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


# -------------------------------------------------------------------- parser
def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's default must not overwrite `halopipe --debug run ...`
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="print the full traceback of a failure")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halopipe", description="Composed interatomic potentials under domain decomposition.")
    parser.add_argument("--version", action="version", version=f"halopipe {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the full traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,run,verify,relax,schema}")
    common = [_common()]

    p = sub.add_parser(
        "demo", parents=common, help="a short MD run of the demo composite on 2 processes (--evaluate: one checked evaluation)"
    )
    p.add_argument("--nproc", type=_positive_int, default=2, help="local processes (default 2)")
    p.add_argument("--atoms", type=_positive_int, default=216, help="approximate number of atoms (default 216)")
    p.add_argument("--steps", type=_steps, default=300, help="MD steps (default 300)")
    p.add_argument("--output", default=None, help="run directory (default runs/halopipe-demo, numbered if it exists)")
    p.add_argument("--evaluate", action="store_true", help="instead, one timed evaluation compared against a single process")
    p.add_argument("--repeats", type=_positive_int, default=3, help="with --evaluate: timed evaluations")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", parents=common, help="run the simulation a YAML configuration describes (see examples/)")
    p.add_argument("config", help="YAML configuration file")
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="local processes to spawn (default: the config's nproc, else 1); ignored under torchrun/srun, which set the ranks",
    )
    p.add_argument("--restart", action="store_true", help="continue the latest run of this configuration from its checkpoint")
    p.add_argument(
        "--allow-changed",
        action="store_true",
        help="with --restart: continue although the models, groups, integrator or system differ from the checkpoint's (logged)",
    )
    p.add_argument("--output", default=None, help="run directory (default: outputs.directory, numbered .1, .2 ... if it exists)")
    p.add_argument("--steps", type=_steps, default=None, help="override the configured total number of steps")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("verify", parents=common, help="evaluate the configured composite distributed and single-process and compare")
    p.add_argument("config", help="YAML configuration file")
    p.add_argument(
        "--nproc", type=_positive_int, default=None, help="ranks of the distributed evaluation (default: the config's, at least 2)"
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("relax", parents=common, help="relax every frame of a structure file with FIRE (--cell: the cell too)")
    p.add_argument("structures", help="structure file (any format ASE reads; every frame)")
    p.add_argument("-o", "--output", required=True, help="extended XYZ of the relaxed frames, with energy and forces")
    p.add_argument("--config", required=True, help="YAML with the potential: models (and groups) as in a run configuration")
    p.add_argument("--fmax", type=_positive_float, default=0.05, help="force criterion per frame, eV/Å (default 0.05)")
    p.add_argument("--steps", type=_steps, default=500, help="most FIRE steps per frame (default 500)")
    p.add_argument("--cell", action="store_true", help="relax the cell too (ASE's FrechetCellFilter)")
    p.add_argument("--pressure", type=float, default=0.0, help="with --cell: external pressure, GPa (default 0)")
    p.add_argument("--batch", type=_positive_int, default=64, help="frames relaxed together, one pipeline call per FIRE step (default 64)")
    p.add_argument("--stop-on-error", action="store_true", help="stop at the first frame that fails (default: go on, exit 1 at the end)")
    p.set_defaults(func=cmd_relax)

    p = sub.add_parser("schema", parents=common, help="print the JSON schema of configuration files (for editors)")
    p.set_defaults(func=cmd_schema)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``halopipe`` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    keep_freed_memory()
    if args.command == "run" and args.allow_changed and not args.restart:
        parser.error("--allow-changed only applies with --restart")
    if args.command == "relax" and args.pressure and not args.cell:
        parser.error("--pressure only applies with --cell")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"halopipe {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        print(failure_message(f"halopipe {args.command}", exc), file=sys.stderr, flush=True)
        return 2 if type(exc).__name__ in _BAD_INPUT else 1
