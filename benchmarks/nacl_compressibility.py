"""NaCl compressibility: NPT volume fluctuations against the bulk modulus of the model's static E(V) curve.

A longer version of tests/dynamics/test_nacl_compressibility.py. The Joung-Cheatham NaCl crystal (64 ions,
Ewald) runs at zero pressure under stochastic cell rescaling (``--barostat csr``) or the isotropic MTK
(``--barostat mtk``); ``kappa_T = <dV²>/(kB T <V>)`` (block-averaged) is compared with ``1/B`` where
``B = V E''(V)`` comes from the static energy curve at the run's mean volume. ``--qha`` adds the classical
quasi-harmonic correction at that volume, ``B_qh = V d²/dV² [E + kB T sum_i ln omega_i]`` (phonons of the
64-ion cell from finite differences of the forces at three volumes), i.e. the systematic difference expected
between the fluctuation and the static-curve moduli at this temperature (intrinsic anharmonicity aside).
For MTK it also prints, in blocks, the volume mode's kinetic temperature ``<p_eps²/W>/kT`` beside
``kappa_fluct/kappa_static``: the mode thermalises slowly, and the second follows the first.

    python benchmarks/nacl_compressibility.py --steps 40000
    python benchmarks/nacl_compressibility.py --barostat mtk --dt 2 --pdamp 1000 --steps 40000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from halopipe.dynamics import IsotropicMTKNPT, Simulation, StochasticCellRescaling  # noqa: E402
from halopipe.dynamics.barostats import BAR_TO_EV_PER_A3  # noqa: E402
from tests.dynamics._nacl import (  # noqa: E402
    EV_PER_A3_TO_GPA,
    KB,
    StaticCurve,
    compressibility_from_fluctuations,
    nacl_crystal,
    nacl_pipeline,
    npt_volumes,
)

AMU_EV_A2_TO_RAD_PER_FS = 0.09822694750253872  # sqrt(eV / (Å² amu)) in rad/fs


def harmonic_log_frequency_sum(volume: float, step: float = 1e-3) -> float:
    """``sum_i ln omega_i`` (rad/fs) over the non-zero phonons of the 64-ion cell at ``volume``."""
    pipeline, system = nacl_pipeline(), nacl_crystal(volume)
    positions, n = system.positions.clone(), len(system.positions)
    hessian = np.zeros((3 * n, 3 * n))
    for row in range(3 * n):
        forces = []
        for sign in (1.0, -1.0):
            displaced = positions.clone()
            displaced[row // 3, row % 3] += sign * step
            forces.append(pipeline(system.replace(positions=displaced))["forces"].numpy().ravel())
        hessian[row] = -(forces[0] - forces[1]) / (2 * step)
    masses = np.repeat(system.masses.numpy(), 3)
    dynamical = hessian / np.sqrt(np.outer(masses, masses))
    omega_sq = np.linalg.eigvalsh(0.5 * (dynamical + dynamical.T))[3:]  # drop the three translations
    return float(0.5 * np.log(omega_sq * AMU_EV_A2_TO_RAD_PER_FS**2).sum())


def quasi_harmonic_bulk_modulus(curve: StaticCurve, volume: float, temperature: float, relative: float = 0.01) -> float:
    h = relative * volume
    logs = [harmonic_log_frequency_sum(volume + k * h) for k in (-1, 0, 1)]
    return curve.bulk_modulus(volume) + volume * KB * temperature * (logs[0] - 2 * logs[1] + logs[2]) / h**2


def mtk_run(simulation: Simulation, integrator: IsotropicMTKNPT, temperature: float, equilibration: int, steps: int):
    """Volumes (Å³) and the volume mode's kinetic temperature ``p_eps² / (W kB T)`` after each step."""
    simulation.set_velocities(temperature, seed=1)
    simulation.run(equilibration)
    volumes, barostat = np.empty(steps), np.empty(steps)
    for k in range(steps):
        simulation.run(1)
        volumes[k] = float(torch.linalg.det(simulation.sharded.cell))
        barostat[k] = integrator.p_eps**2 / integrator.barostat_mass / (KB * temperature)
    return volumes, barostat


def report_volume_mode(curve: StaticCurve, volumes: np.ndarray, barostat: np.ndarray, temperature: float, blocks: int, omega_dt: float):
    """Per block: the volume mode's kinetic temperature and its configurational one, ``kappa_fluct / kappa_static``.

    A harmonic volume mode integrated by velocity Verlet has ``<x²> k = <p²/m> / (1 - (omega dt / 2)²)``; the two
    columns should keep that ratio block by block even while the mode's energy wanders.
    """
    print(f"volume mode: omega dt = {omega_dt:.3f}; Verlet predicts configurational/kinetic = {1 / (1 - omega_dt**2 / 4):.4f}")
    print("| block | <p_eps²/W>/kT | kappa_fluct/kappa_static |")
    print("|---|---|---|")
    for k, (v, b) in enumerate(zip(np.array_split(volumes, blocks), np.array_split(barostat, blocks))):
        print(f"| {k} | {b.mean():.3f} | {v.var() / (KB * temperature * v.mean()) * curve.bulk_modulus(v.mean()):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--barostat", choices=["csr", "mtk"], default="csr")
    parser.add_argument("--temperature", type=float, default=30.0, help="K")
    parser.add_argument("--dt", type=float, default=4.0, help="fs")
    parser.add_argument("--taup", type=float, default=100.0, help="CSR relaxation time, fs")
    parser.add_argument("--pdamp", type=float, default=1000.0, help="MTK barostat time constant, fs")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--equilibration", type=int, default=500)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--qha", action="store_true", help="also compute the quasi-harmonic correction (about 1 min)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)

    pipeline = nacl_pipeline()
    curve = StaticCurve(pipeline)
    b0 = curve.bulk_modulus(curve.v0)
    print(f"static curve: a0 = {curve.lattice_constant:.4f} Å, V0 = {curve.v0:.2f} Å³, fit residual {curve.residual:.1e} eV")
    print(f"B0 = {b0:.5f} eV/Å³ ({b0 * EV_PER_A3_TO_GPA:.2f} GPa)")

    t, dt = args.temperature, args.dt
    if args.barostat == "csr":
        beta = BAR_TO_EV_PER_A3 / b0  # 1/bar
        integrator = StochasticCellRescaling(dt, t, 0.0, compressibility=beta, taup=args.taup, friction=0.01, seed=args.seed)
        euler = 0.5 * dt / args.taup  # Euler-Maruyama: <dV²> too large by 1/(1 - dt/(2 tau_eff)), tau_eff = taup here
        print(f"CSR: dt = {dt} fs, taup = {args.taup} fs, compressibility 1/B0; expected Euler excess in kappa: {euler / (1 - euler):.2%}")
    else:
        integrator = IsotropicMTKNPT(dt, t, 0.0, tdamp=100 * dt, pdamp=args.pdamp)
        print(f"MTK: dt = {dt} fs, pdamp = {args.pdamp} fs, tdamp = {100 * dt} fs")
    simulation = Simulation(pipeline, nacl_crystal(curve.v0), integrator)
    start = time.perf_counter()
    if args.barostat == "mtk":
        volumes, barostat = mtk_run(simulation, integrator, t, args.equilibration, args.steps)
    else:
        volumes = npt_volumes(simulation, t, args.equilibration, args.steps)
    wall = time.perf_counter() - start
    kappa, error = compressibility_from_fluctuations(volumes, t, args.blocks)
    mean_volume = float(volumes.mean())
    reference = 1.0 / curve.bulk_modulus(mean_volume)
    print(f"{args.steps} steps at {t} K in {wall:.0f} s: <V> = {mean_volume:.2f} Å³ (a = {(mean_volume / 8) ** (1 / 3):.4f} Å)")
    print(f"kappa_T from fluctuations: {kappa:.4f} +- {error:.4f} (eV/Å³)^-1, i.e. B = {1 / kappa * EV_PER_A3_TO_GPA:.2f} GPa")
    print(f"kappa from the static curve at <V>: {reference:.4f}, i.e. B = {1 / reference * EV_PER_A3_TO_GPA:.2f} GPa")
    print(f"ratio fluctuation/static: {kappa / reference:.4f} +- {error / reference:.4f}")
    if args.barostat == "mtk":
        stiffness = 9.0 * mean_volume * curve.bulk_modulus(mean_volume)  # d²G/d eps², eps = ln(cell length)
        report_volume_mode(curve, volumes, barostat, t, 6, dt * (stiffness / integrator.barostat_mass) ** 0.5)
    if args.qha:
        b_qh = quasi_harmonic_bulk_modulus(curve, mean_volume, t)
        ratio = curve.bulk_modulus(mean_volume) / b_qh
        print(f"quasi-harmonic B at <V>: {b_qh * EV_PER_A3_TO_GPA:.2f} GPa; kappa_qh/kappa_static = {ratio:.4f}")


if __name__ == "__main__":
    main()
