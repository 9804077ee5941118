"""A nudged elastic band whose images are evaluated as one batch per step.

A Cu adatom hops between two neighbouring hollow sites of a Cu(100) slab
(Lennard-Jones Cu, ε = 0.4093 eV, σ = 2.338 Å). ASE's NEB (improved tangent,
climbing image) with ASE's FIRE moves the band; the images' energies and
forces come either from one :class:`halopipe.ase.BatchCalculator` (every
image that moved is evaluated in one ``pipeline([...])`` call per step) or,
for comparison, from one :class:`halopipe.ase.Calculator` per image (one call
per image per step). Both bands are the same to float64 rounding; the batch
makes ``steps`` calls instead of ``steps x images``.

    python examples/neb_batch.py --images 9
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from ase.build import add_adsorbate, fcc100
from ase.mep import NEB
from ase.optimize import FIRE

from halopipe import LennardJones, Pipeline
from halopipe.ase import BatchCalculator, Calculator

CU = {"epsilon": {29: 0.4093}, "sigma": {29: 2.338}, "cutoff": 6.0}


def band(n_images: int) -> list:
    """End points relaxed on the slab's fixed geometry, then the images in between (copies, interpolated by NEB)."""
    initial = fcc100("Cu", size=(3, 3, 3), vacuum=6.0, a=3.7)
    add_adsorbate(initial, "Cu", 1.8, "hollow")
    final = initial.copy()
    final.positions[-1, 0] += initial.cell[0, 0] / 3  # the next hollow site along x
    for end in (initial, final):
        end.calc = Calculator(Pipeline([LennardJones(**CU)]))
        FIRE(end, logfile=None).run(fmax=0.01, steps=200)
    return [initial] + [initial.copy() for _ in range(n_images - 2)] + [final]


def run(n_images: int, batched: bool, fmax: float, steps: int) -> dict:
    images = band(n_images)
    if batched:
        server = BatchCalculator(Pipeline([LennardJones(**CU)]))
        server.attach(images[1:-1])
    else:
        for image in images[1:-1]:
            image.calc = Calculator(Pipeline([LennardJones(**CU)]))
    neb = NEB(images, climb=True, method="improvedtangent")
    neb.interpolate()
    start = time.perf_counter()
    optimizer = FIRE(neb, logfile=None)
    optimizer.run(fmax=fmax, steps=steps)
    seconds = time.perf_counter() - start
    energies = np.array([image.get_potential_energy() for image in images])
    return {
        "seconds": seconds,
        "steps": optimizer.nsteps,
        "barrier": float(energies.max() - energies[0]),
        "positions": np.array([i.positions for i in images]),
        "calls": server.calls if batched else optimizer.nsteps * (n_images - 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=7, help="images including the two end points (default 7)")
    parser.add_argument("--fmax", type=float, default=0.02)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    one_each = run(args.images, batched=False, fmax=args.fmax, steps=args.steps)
    batch = run(args.images, batched=True, fmax=args.fmax, steps=args.steps)
    for label, r in (("a calculator per image", one_each), ("one batch per step", batch)):
        print(f"{label:>24}: barrier {r['barrier']:.6f} eV, {r['steps']} steps, {r['calls']} pipeline calls, {r['seconds']:.2f} s")
    print(f"largest position difference between the two bands: {np.abs(batch['positions'] - one_each['positions']).max():.1e} Å")


if __name__ == "__main__":
    main()
