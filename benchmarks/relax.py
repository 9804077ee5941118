"""Relaxing many small structures: ``halopipe relax``'s batches against a loop of ASE FIRE runs, side by side.

``--structures`` small periodic structures of 8 to 64 atoms, rattled by 0.1 Å (a different seed each), are relaxed
to ``--fmax`` with ASE's FIRE at fixed cell two ways, one after the other in one process (one thread, float64):

* ``loop``: for each structure, ``FIRE(atoms).run()`` with :class:`halopipe.ase.Calculator` (one calculator,
  as a user's loop over structures is written);
* ``batch``: :func:`halopipe.cli.relax.relax_frames`, ``--batch`` structures at a time (one pipeline call per FIRE
  iteration for all of them, a structure leaving when converged).

Both take the same FIRE path per structure (tests/test_ase_batch.py checks it), so the step counts agree; the
table gives structures per second and the ratio. Potentials: ``lj`` (Lennard-Jones Cu on fcc Cu cells) and
``demo`` (the demo composite, ChargeModel -> DSFCoulomb wired plus LJ, on rock-salt NaCl cells).

    python benchmarks/relax.py --structures 100 --batch 100
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import print_table  # noqa: E402

from halopipe.cli.relax import RelaxSettings, load_potential, relax_frames  # noqa: E402

POTENTIALS = {
    "lj": {"models": {"lj": {"type": "LennardJones", "epsilon": {"Cu": 0.4093}, "sigma": {"Cu": 2.338}, "cutoff": 6.0}}},
    "demo": {
        "models": {
            "lj": {"type": "LennardJones", "epsilon": {"Na": 0.0115, "Cl": 0.0043}, "sigma": {"Na": 2.0, "Cl": 3.4}, "cutoff": 8.0},
            "charges": {"type": "ChargeModel", "cutoff": 4.0, "coordination_weight": 0.02},
            "coulomb": {"type": "DSFCoulomb", "cutoff": 10.0, "alpha": 0.2},
        },
        "groups": [{"steps": ["lj"], "autograd": False}, {"steps": ["charges", "coulomb"], "autograd": True}],
    },
}
REPEATS = [(1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2), (1, 1, 1), (2, 1, 2), (1, 2, 1)]  # 8 to 64 atoms


def structures(kind: str, count: int) -> list:
    from ase.build import bulk

    out = []
    for k in range(count):
        cell = bulk("Cu", "fcc", a=3.7, cubic=True) if kind == "lj" else bulk("NaCl", "rocksalt", a=5.64, cubic=True)
        atoms = cell.repeat(REPEATS[k % len(REPEATS)])
        atoms.rattle(0.1, seed=k)
        out.append(atoms)
    return out


def loop(frames: list, potential, settings: RelaxSettings) -> list[int]:
    from ase.optimize import FIRE

    from halopipe.ase import Calculator

    calculator = Calculator(potential.pipeline)
    steps = []
    for atoms in frames:
        atoms = atoms.copy()
        atoms.calc = calculator
        optimizer = FIRE(atoms, logfile=None)
        optimizer.run(fmax=settings.fmax, steps=settings.steps)
        steps.append(optimizer.nsteps)
    return steps


def batched(frames: list, potential, settings: RelaxSettings) -> list[int]:
    outcomes = sorted(relax_frames(frames, potential, settings), key=lambda o: o.index)
    return [o.steps for o in outcomes]


def run(kind: str, count: int, batch: int, fmax: float) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(POTENTIALS[kind]))
        potential = load_potential(path)
    frames = structures(kind, count)
    settings = RelaxSettings(fmax=fmax, steps=1000, batch=batch)
    rows, steps = [], {}
    for way, fn in (("loop of ASE FIRE runs", loop), (f"relax_frames, batch {batch}", batched)):
        start = time.perf_counter()
        steps[way] = fn(frames, potential, settings)
        seconds = time.perf_counter() - start
        rows.append([kind, way, f"{seconds:.1f}", f"{count / seconds:.2f}", sum(steps[way])])
    loop_seconds = float(rows[0][2])
    for row in rows:
        row.append(f"{float(row[2]) / loop_seconds:.2f}x")
    same = len({tuple(s) for s in steps.values()}) == 1
    rows.append([kind, "same step counts per structure", "", "", "", "yes" if same else "NO"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", type=int, default=100)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--potentials", nargs="+", default=sorted(POTENTIALS), choices=sorted(POTENTIALS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for kind in args.potentials for row in run(kind, args.structures, args.batch, args.fmax)]
    header = ["potential", "way", "seconds", "structures/s", "FIRE steps", "time vs loop"]
    print_table(f"{args.structures} structures of 8-64 atoms to fmax {args.fmax} eV/Å, 1 process, 1 thread, float64", header, rows)


if __name__ == "__main__":
    main()
