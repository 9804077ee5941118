"""MACE + DFT-D3 under domain decomposition: per-layer refresh vs wide halo.

A random-weight MACE of realistic size (128x0e+128x1o, 2 interactions, r_max
5 Å, correlation 3) plus DFT-D3(PBE, BJ) on an amorphous H/C/O box of about 8k
atoms at 0.1 atoms/Å³, on 2 ranks (gloo, CPU, float64), energy + forces +
stress per evaluation:

* MACE ``halo_mode="layer"`` (halo r_max, ghost features refreshed between
  layers) vs ``"wide"`` (halo 2 r_max, no refresh);
* ``halo="per_model"`` vs ``"max"`` (MACE gets D3's halo too);
* the everyday baseline: mace-torch's ``MACECalculator`` + s-dftd3 summed in
  one process.

    python benchmarks/mlip_halo.py --atoms 8000 --nproc 2

Memory: mace-torch's own forward+backward for this model takes ~12 MB per atom
in float64 on CPU (measured: 4.0 GB for 343 atoms, 9 s), so 8k atoms need a
GPU or ~100 GB of RAM. On the 2-core, 24 GB development machine the wide
halo of even 512 atoms ran out of memory, so the table in docs/benchmarks.md
was made with ``--atoms 1000 --channels 16 --max-ell 2``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import max_over_ranks, print_table, rank, timed  # noqa: E402

D3_CUTOFF, D3_CN_CUTOFF = 15.0, 10.0
SPECIES = (1, 6, 8)


def build_mace(seed: int = 0, channels: int = 128, max_ell: int = 3):
    import mace  # noqa: F401  (sets up e3nn's constants under torch >= 2.6)
    from e3nn import o3
    from mace import modules

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = modules.ScaleShiftMACE(
            r_max=5.0,
            num_bessel=8,
            num_polynomial_cutoff=5,
            max_ell=3,
            interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
            num_interactions=2,
            num_elements=3,
            hidden_irreps=o3.Irreps(f"{channels}x0e+{channels}x1o"),
            MLP_irreps=o3.Irreps("16x0e"),
            atomic_energies=np.array([-1.1, -2.3, -3.7]),
            avg_num_neighbors=30.0,
            atomic_numbers=list(SPECIES),
            correlation=3,
            gate=torch.nn.functional.silu,
            radial_MLP=[64, 64, 64],
            atomic_inter_scale=1.0,
            atomic_inter_shift=0.0,
        )
    finally:
        torch.set_default_dtype(old)
    return model.double()


def amorphous(n_atoms: int, density: float = 0.1, seed: int = 0):
    """A jittered simple-cubic grid of random H/C/O (no close contacts), as ase.Atoms."""
    from ase import Atoms

    side = int(round(n_atoms ** (1 / 3)))
    n = side**3
    length = (n / density) ** (1 / 3)
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)
    frac = (grid + rng.uniform(-0.15, 0.15, grid.shape)) / side
    return Atoms(numbers=rng.choice(SPECIES, n), scaled_positions=frac, cell=np.eye(3) * length, pbc=True)


def distributed_case(n_atoms: int, repeats: int, mace_mode: str, halo: str, channels: int, max_ell: int) -> dict:
    from halopipe import DFTD3, MACE, Group, Pipeline, Step, System
    from halopipe.distributed import DomainConfig, ShardedSystem

    torch.set_num_threads(1)
    system = System.from_ase(amorphous(n_atoms)) if rank() == 0 else None
    pipeline = Pipeline(
        [
            Group(
                [
                    Step(MACE(build_mace(channels=channels, max_ell=max_ell), halo_mode=mace_mode)),
                    Step(DFTD3("pbe", cutoff=D3_CUTOFF, cn_cutoff=D3_CN_CUTOFF)),
                ]
            )
        ],
        config=DomainConfig(skin=0.5, halo=halo, timeout=3600),
    )
    sharded = ShardedSystem.scatter(system, pipeline.config)
    pipeline(sharded, stress=True)
    seconds, out = timed(lambda: pipeline(sharded, stress=True), repeats)
    ghosts = max_over_ranks([float(out["halo"]["MACE"]), float(out["halo"]["DFTD3"])])
    return {
        "seconds": max_over_ranks([seconds])[0],
        "mace_ghosts": int(ghosts[0]),
        "d3_ghosts": int(ghosts[1]),
        "energy": float(out["energy"]),
        "n": sharded.n_total,
    }


def baseline(n_atoms: int, repeats: int, channels: int, max_ell: int) -> dict:
    """mace-torch's calculator + s-dftd3 in one process (1 thread), summed."""
    from ase import units
    from dftd3.interface import DispersionModel, RationalDampingParam
    from mace.calculators import MACECalculator

    torch.set_num_threads(1)
    atoms = amorphous(n_atoms)
    calc = MACECalculator(models=build_mace(channels=channels, max_ell=max_ell), default_dtype="float64", device="cpu")
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        atoms.calc = calc
        e = atoms.get_potential_energy()
        atoms.get_forces()
        atoms.get_stress()
        disp = DispersionModel(atoms.numbers, atoms.positions / units.Bohr, atoms.cell.array / units.Bohr, np.array([True] * 3))
        disp.set_realspace_cutoff(D3_CUTOFF / units.Bohr, D3_CUTOFF / units.Bohr, D3_CN_CUTOFF / units.Bohr)
        res = disp.get_dispersion(RationalDampingParam(method="pbe"), grad=True)
        e += res["energy"] * units.Hartree
        best = min(best, time.perf_counter() - t0)
        calc.reset()
    return {"seconds": best, "energy": e, "n": len(atoms)}


def main() -> None:
    from halopipe.distributed.launch import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atoms", type=int, default=8000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--channels", type=int, default=128, help="multiplicity of 0e and 1o hidden irreps (128: realistic size)")
    parser.add_argument("--max-ell", type=int, default=3, help="spherical harmonics order of the edges")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["layer:per_model", "wide:per_model", "layer:max"],
        help="MACE halo mode and pipeline halo of each distributed row, as mode:halo",
    )
    args = parser.parse_args()
    rows = []
    for mode, halo in (tuple(c.split(":")) for c in args.configs):
        r = spawn(distributed_case, args.nproc, args.atoms, args.repeats, mode, halo, args.channels, args.max_ell, timeout=3600)[0]
        rows.append(
            [
                f"MACE {mode} + D3, halo={halo}",
                f"{args.nproc} ranks",
                r["n"],
                r["mace_ghosts"],
                r["d3_ghosts"],
                f"{r['seconds']:.2f}",
                f"{r['energy']:.6f}",
            ]
        )
    b = spawn(baseline, 1, args.atoms, args.repeats, args.channels, args.max_ell, timeout=3600)[0]
    rows.append(["MACECalculator + s-dftd3 (summed)", "1 process", b["n"], "-", "-", f"{b['seconds']:.2f}", f"{b['energy']:.6f}"])
    print_table(
        f"MACE ({args.channels}x0e+{args.channels}x1o, max_ell {args.max_ell}, 2 layers, r_max 5 Å) "
        f"+ D3(PBE, BJ, {D3_CUTOFF}/{D3_CN_CUTOFF} Å), float64, E+F+stress, 1 thread per rank",
        ["configuration", "ranks", "atoms", "MACE ghost rows (max rank)", "D3 ghost rows (max rank)", "s / evaluation", "energy / eV"],
        rows,
    )


if __name__ == "__main__":
    main()
