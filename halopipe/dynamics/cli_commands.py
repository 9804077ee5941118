"""Command-line entry points of the dynamics: ``halopipe run``, ``halopipe verify``, ``halopipe demo``.

``halopipe.cli`` hooks these in with :func:`add_run_parser`,
:func:`add_verify_parser` and :func:`add_demo_parser` (or :func:`run_demo_md`
as the demo's handler). Configuration errors are printed as one line naming
the offending key, with exit status 2.
"""

from __future__ import annotations

import argparse

__all__ = ["add_run_parser", "add_verify_parser", "add_demo_parser", "cmd_run", "cmd_verify", "run_demo_md"]


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


def cmd_run(args: argparse.Namespace) -> int:
    """``halopipe run config.yaml [--nproc N] [--restart] [--output DIR] [--steps N]``."""
    from ..config import ConfigError
    from .run import load, main_error, run_config

    try:
        config = load(args.config, args.steps)
        return run_config(config, nproc=args.nproc, restart=args.restart, output=args.output)
    except (ConfigError, FileNotFoundError) as exc:
        return main_error("halopipe run", exc)


def cmd_verify(args: argparse.Namespace) -> int:
    """``halopipe verify config.yaml --nproc N``."""
    from ..config import ConfigError
    from .run import load, main_error, verify_config

    try:
        return verify_config(load(args.config), nproc=args.nproc)
    except (ConfigError, FileNotFoundError) as exc:
        return main_error("halopipe verify", exc)


def run_demo_md(args: argparse.Namespace) -> int:
    """``halopipe demo``: a short MD run of the demo composite on 2 processes (see :data:`~halopipe.dynamics.run.DEMO_CONFIG`)."""
    if getattr(args, "evaluate", False):
        from ..cli import _cmd_demo

        return _cmd_demo(args)
    from .run import run_demo

    return run_demo(
        nproc=getattr(args, "nproc", 2),
        atoms=getattr(args, "atoms", 216),
        steps=getattr(args, "steps", 300),
        output=getattr(args, "output", None),
    )


def add_run_parser(sub) -> argparse.ArgumentParser:
    """Add ``run`` to an ``add_subparsers()`` object."""
    p = sub.add_parser("run", help="run the simulation a YAML configuration describes (see examples/)")
    p.add_argument("config", help="YAML configuration file")
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=None,
        help="local processes to spawn (default: the config's nproc, else 1); ignored under torchrun/srun, which set the ranks",
    )
    p.add_argument("--restart", action="store_true", help="continue the latest run of this configuration from its checkpoint")
    p.add_argument("--output", default=None, help="run directory (default: outputs.directory, numbered .1, .2 ... if it exists)")
    p.add_argument("--steps", type=_steps, default=None, help="override the configured total number of steps")
    p.set_defaults(func=cmd_run)
    return p


def add_verify_parser(sub) -> argparse.ArgumentParser:
    """Add ``verify`` to an ``add_subparsers()`` object."""
    p = sub.add_parser("verify", help="evaluate the configured composite distributed and single-process and compare")
    p.add_argument("config", help="YAML configuration file")
    p.add_argument(
        "--nproc", type=_positive_int, default=None, help="ranks of the distributed evaluation (default: the config's, at least 2)"
    )
    p.set_defaults(func=cmd_verify)
    return p


def add_demo_parser(sub) -> argparse.ArgumentParser:
    """Add ``demo`` (the short MD run) to an ``add_subparsers()`` object."""
    p = sub.add_parser("demo", help="a short MD run of the demo composite (ChargeModel->DSFCoulomb wired + LennardJones) on 2 processes")
    p.add_argument("--nproc", type=_positive_int, default=2, help="local processes (default 2)")
    p.add_argument("--atoms", type=_positive_int, default=216, help="approximate number of atoms (default 216)")
    p.add_argument("--steps", type=_steps, default=300, help="MD steps (default 300)")
    p.add_argument("--output", default=None, help="run directory (default runs/demo, numbered if it exists)")
    p.add_argument("--evaluate", action="store_true", help="instead, one timed evaluation compared against a single process")
    p.add_argument("--repeats", type=_positive_int, default=3, help="with --evaluate: timed evaluations")
    p.set_defaults(func=run_demo_md)
    return p
