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

``--model 7net-0`` runs the pretrained SevenNet-0 (the ``[sevenn]`` extra, in
its own environment) + DFT-D3(PBE, BJ) at D3's default cutoffs (50.2 / 21.2 Å)
on AB bilayer graphene with Li in the gallery (examples/data/make_bilayer_li.py),
SevenNet in float32 (its trained precision, positions and D3 in float64):

* per-layer refresh with per-model halos (``layer:per_model``);
* the LAMMPS ``hybrid/overlay`` style single halo, SevenNet gets D3's 50 Å
  halo (``layer:max``);
* the wide halo, 5 layers x 5 Å (``wide:per_model``);
* the everyday baseline: sevenn's ``SevenNetCalculator`` + s-dftd3 summed in
  one process.

Each row reports MLIP and D3 ghost rows and the peak RSS of the largest rank.

    python benchmarks/mlip_halo.py --model 7net-0 --atoms 2000 --nproc 2

Memory: mace-torch's own forward+backward for this model takes ~12 MB per atom
in float64 on CPU (measured: 4.0 GB for 343 atoms, 9 s), so 8k atoms need a
GPU or ~100 GB of RAM. On the 2-core, 24 GB development machine the wide
halo of even 512 atoms ran out of memory, so the table in docs/benchmarks.md
was made with ``--atoms 1000 --channels 16 --max-ell 2``.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
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


def decomposed_case(system_of, mlip, mlip_name: str, d3, halo: str, repeats: int) -> dict:
    """MLIP + D3 as one autograd group on the launched ranks: best seconds per E+F+stress evaluation (after one
    warm-up), the largest rank's MLIP and D3 ghost rows and peak RSS, the energy and the atom count."""
    from halopipe import DomainConfig, Group, Pipeline, Step, System
    from halopipe.distributed import ShardedSystem

    torch.set_num_threads(1)
    system = System.from_ase(system_of()) if rank() == 0 else None
    pipeline = Pipeline([Group([Step(mlip), Step(d3)])], config=DomainConfig(skin=0.5, halo=halo, timeout=3600))
    sharded = ShardedSystem.scatter(system, pipeline.config)
    pipeline(sharded, stress=True)
    seconds, out = timed(lambda: pipeline(sharded, stress=True), repeats)
    largest = max_over_ranks([float(out["halo"][mlip_name]), float(out["halo"]["DFTD3"]), peak_rss_gb(), seconds])
    return {
        "seconds": largest[3],
        "mlip_ghosts": int(largest[0]),
        "d3_ghosts": int(largest[1]),
        "rss": largest[2],
        "energy": float(out["energy"]),
        "n": sharded.n_total,
    }


def calculator_case(atoms, calc, repeats: int, cutoff: float | None, cn_cutoff: float | None) -> dict:
    """An ASE calculator + s-dftd3 (PBE, BJ, no ATM) summed in one process: best seconds per E+F+stress evaluation
    over ``repeats`` after one warm-up call (as in the decomposed rows). ``cutoff=None``: the calculator alone."""
    from ase import units
    from dftd3.interface import DispersionModel, RationalDampingParam

    torch.set_num_threads(1)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        atoms.calc = calc
        e = atoms.get_potential_energy()
        atoms.get_forces()
        atoms.get_stress()
        if cutoff is None:
            best = min(best, time.perf_counter() - t0)
            calc.reset()
            continue
        disp = DispersionModel(atoms.numbers, atoms.positions / units.Bohr, atoms.cell.array / units.Bohr, np.array([True] * 3))
        disp.set_realspace_cutoff(cutoff / units.Bohr, cutoff / units.Bohr, cn_cutoff / units.Bohr)
        res = disp.get_dispersion(RationalDampingParam(method="pbe", atm=False), grad=True)
        e += res["energy"] * units.Hartree
        best = min(best, time.perf_counter() - t0)
        calc.reset()
    return {"seconds": best, "energy": e, "n": len(atoms), "rss": peak_rss_gb()}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in kB on Linux


def mace_case(n_atoms: int, repeats: int, mace_mode: str, halo: str, channels: int, max_ell: int) -> dict:
    from halopipe import DFTD3, MACE

    mace = MACE(build_mace(channels=channels, max_ell=max_ell), halo_mode=mace_mode)
    d3 = DFTD3("pbe", cutoff=D3_CUTOFF, cn_cutoff=D3_CN_CUTOFF)
    return decomposed_case(lambda: amorphous(n_atoms), mace, "MACE", d3, halo, repeats)


def mace_baseline(n_atoms: int, repeats: int, channels: int, max_ell: int) -> dict:
    """mace-torch's calculator + s-dftd3 in one process (1 thread), summed."""
    from mace.calculators import MACECalculator

    calc = MACECalculator(models=build_mace(channels=channels, max_ell=max_ell), default_dtype="float64", device="cpu")
    return calculator_case(amorphous(n_atoms), calc, repeats, D3_CUTOFF, D3_CN_CUTOFF)


# ------------------------------------------------------------------------------------------ SevenNet-0
def bilayer(n_atoms: int):
    """Bilayer graphene + Li (the example's structure) with about ``n_atoms`` atoms."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data"))
    from make_bilayer_li import bilayer_li

    n = max(2, math.ceil((n_atoms / 4.1) ** 0.5))  # at least n_atoms atoms
    return bilayer_li(n_in_plane=n, n_li=max(1, n * n * 4 * 24 // 1024))


def sevennet_case(n_atoms: int, repeats: int, mode: str, halo: str, options: dict) -> dict:
    from halopipe import DFTD3, SevenNet

    mlip = SevenNet("7net-0", halo_mode=mode, dtype="float32", **options)
    return decomposed_case(lambda: bilayer(n_atoms), mlip, "SevenNet", DFTD3("pbe"), halo, repeats)


def sevennet_baseline(n_atoms: int, repeats: int) -> dict:
    """sevenn's SevenNetCalculator + s-dftd3 (default cutoffs) in one process (1 thread), summed."""
    from sevenn.calculator import SevenNetCalculator

    from halopipe.models.dftd3 import DEFAULT_CN_CUTOFF, DEFAULT_CUTOFF

    return calculator_case(bilayer(n_atoms), SevenNetCalculator("7net-0", device="cpu"), repeats, DEFAULT_CUTOFF, DEFAULT_CN_CUTOFF)


def nve_drift(n_atoms: int, steps: int, dtype: str, options: dict, timestep: float = 1.0) -> dict:
    """NVE (velocity Verlet) of SevenNet-0 + D3 from 300 K on one process: drift of the total energy, eV/atom/ps."""
    from halopipe import DFTD3, DomainConfig, Group, Pipeline, SevenNet, Step, System
    from halopipe.dynamics import Reporter, Simulation, VelocityVerlet

    class Energies(Reporter):
        needs_thermo = True

        def __init__(self) -> None:
            super().__init__(1)
            self.t, self.e = [], []

        def report(self, sim, thermo) -> None:
            self.t.append(thermo["time"] / 1000.0)
            self.e.append(thermo["total"])

    torch.set_num_threads(1)
    system = System.from_ase(bilayer(n_atoms))
    mlip = SevenNet("7net-0", dtype=dtype, **options)
    pipeline = Pipeline([Group([Step(mlip), Step(DFTD3("pbe"))])], config=DomainConfig(skin=1.0))
    energies = Energies()
    sim = Simulation(pipeline, system, VelocityVerlet(timestep), reporters=[energies])
    sim.set_velocities(300.0, seed=1)
    t0 = time.perf_counter()
    sim.run(steps)
    seconds = time.perf_counter() - t0
    t, e = np.array(energies.t), np.array(energies.e)
    return {
        "n": system.n_atoms,
        "drift": float(np.polyfit(t, e, 1)[0]) / system.n_atoms,
        "excursion": float(np.abs(e - e[0]).max()) / system.n_atoms,
        "seconds_per_step": seconds / steps,
    }


def drift_main(args) -> None:
    from halopipe.distributed.launch import spawn

    rows = []
    for dtype in ("float32", "float64"):
        r = spawn(nve_drift, 1, args.drift_atoms, args.drift_steps, dtype, sevennet_options(args), timeout=36000)[0]
        rows.append([dtype, r["n"], args.drift_steps, f"{r['drift']:.2e}", f"{r['excursion']:.2e}", f"{r['seconds_per_step']:.2f}"])
    print_table(
        f"NVE, SevenNet-0{options_label(args)} + D3(PBE, BJ, default cutoffs), bilayer graphene + Li from 300 K, dt 1 fs, "
        f"{args.drift_steps} steps, 1 process",
        ["SevenNet dtype", "atoms", "steps", "drift / eV/atom/ps", "largest |E - E0| / eV/atom", "s / step"],
        rows,
    )


def sevennet_options(args) -> dict:
    """SevenNet's ``compile`` and ``checkpoint`` options from the command line."""
    return {"compile": args.compile, "checkpoint": args.checkpoint}


def options_label(args) -> str:
    return "".join(f", {name}" for name, on in (("compiled", args.compile), ("checkpointed", args.checkpoint)) if on)


def sevennet_main(args) -> None:
    from halopipe.distributed.launch import spawn

    if args.drift_steps:
        drift_main(args)
        return

    names = {
        ("layer", "per_model"): "SevenNet per-layer refresh + D3, per-model halos",
        ("layer", "max"): "SevenNet per-layer refresh + D3, single halo (MLIP gets D3's)",
        ("wide", "per_model"): "SevenNet wide halo (25 Å) + D3, per-model halos",
    }
    rows = []
    for mode, halo in (tuple(c.split(":")) for c in args.configs):
        r = spawn(sevennet_case, args.nproc, args.atoms, args.repeats, mode, halo, sevennet_options(args), timeout=3600)[0]
        rows.append(
            [
                names[(mode, halo)],
                args.nproc,
                r["n"],
                r["mlip_ghosts"],
                r["d3_ghosts"],
                f"{r['seconds']:.1f}",
                f"{r['rss']:.2f}",
                f"{r['energy']:.4f}",
            ]
        )
    if args.baseline:
        b = spawn(sevennet_baseline, 1, args.atoms, args.repeats, timeout=3600)[0]
        rows.append(
            ["SevenNetCalculator + s-dftd3, summed", 1, b["n"], "-", "-", f"{b['seconds']:.1f}", f"{b['rss']:.2f}", f"{b['energy']:.4f}"]
        )
    print_table(
        f"SevenNet-0 (float32{options_label(args)}) + D3(PBE, BJ, 50.2/21.2 Å), bilayer graphene + Li, E+F+stress, 1 thread per rank",
        [
            "configuration",
            "ranks",
            "atoms",
            "MLIP ghost rows (max rank)",
            "D3 ghost rows (max rank)",
            "s / evaluation",
            "peak RSS / GB (max rank)",
            "energy / eV",
        ],
        rows,
    )


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
    parser.add_argument(
        "--model", choices=["mace", "7net-0"], default="mace", help="random-weight MACE, or pretrained SevenNet-0 ([sevenn] extra)"
    )
    parser.add_argument(
        "--drift-steps", type=int, default=0, help="7net-0: instead, NVE drift over this many 1 fs steps (float32, float64)"
    )
    parser.add_argument("--drift-atoms", type=int, default=100, help="7net-0: atoms of the NVE drift run")
    parser.add_argument("--compile", action="store_true", help="7net-0: SevenNet with compile=True")
    parser.add_argument("--checkpoint", action="store_true", help="7net-0: SevenNet with checkpoint=True (per-layer recompute)")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="7net-0: skip the one-process calculator row")
    args = parser.parse_args()
    if args.model == "7net-0":
        sevennet_main(args)
        return
    rows = []
    for mode, halo in (tuple(c.split(":")) for c in args.configs):
        r = spawn(mace_case, args.nproc, args.atoms, args.repeats, mode, halo, args.channels, args.max_ell, timeout=3600)[0]
        rows.append(
            [
                f"MACE {mode} + D3, halo={halo}",
                f"{args.nproc} ranks",
                r["n"],
                r["mlip_ghosts"],
                r["d3_ghosts"],
                f"{r['seconds']:.2f}",
                f"{r['energy']:.6f}",
            ]
        )
    b = spawn(mace_baseline, 1, args.atoms, args.repeats, args.channels, args.max_ell, timeout=3600)[0]
    rows.append(["MACECalculator + s-dftd3 (summed)", "1 process", b["n"], "-", "-", f"{b['seconds']:.2f}", f"{b['energy']:.6f}"])
    print_table(
        f"MACE ({args.channels}x0e+{args.channels}x1o, max_ell {args.max_ell}, 2 layers, r_max 5 Å) "
        f"+ D3(PBE, BJ, {D3_CUTOFF}/{D3_CN_CUTOFF} Å), float64, E+F+stress, 1 thread per rank",
        ["configuration", "ranks", "atoms", "MACE ghost rows (max rank)", "D3 ghost rows (max rank)", "s / evaluation", "energy / eV"],
        rows,
    )


if __name__ == "__main__":
    main()
