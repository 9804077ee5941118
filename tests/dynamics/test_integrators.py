"""Integrators, the counter-based generator and initial velocities, against independent references.

* Velocity Verlet against ASE's VelocityVerlet with ASE's Lennard-Jones calculator.
* Langevin BAOAB against a NumPy BAOAB driven by ASE forces and the same noise.
* Langevin equipartition for an ideal gas (analytic temperature).
* Nosé-Hoover chain: conservation of the extended energy and the canonical mean temperature.
* FIRE: relaxes a rattled crystal back to the perfect lattice (energy from ASE).
* The generator against a pure-Python SplitMix64; Maxwell-Boltzmann moments against kB T / m.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ase import units
from ase.calculators.lj import LennardJones as AseLJ

from halopipe import LennardJones, Pipeline, System
from halopipe.distributed import DomainConfig
from halopipe.distributed.launch import spawn
from halopipe.dynamics import FIRE, Langevin, NoseHooverChain, Reporter, Simulation, VelocityVerlet, maxwell_boltzmann
from halopipe.dynamics.random import LANGEVIN, _splitmix64_int, gaussian, splitmix64, uniform
from halopipe.dynamics.units import ACCELERATION, KB, KINETIC

from ._workers import argon, invariance_run

EPS, SIGMA, RC = 0.0104, 3.4, 6.0


class Record(Reporter):
    """Keeps the thermo dict of every reported step."""

    needs_thermo = True

    def __init__(self, every: int = 1) -> None:
        super().__init__(every)
        self.rows: list[dict] = []

    def report(self, sim, thermo) -> None:
        self.rows.append(thermo)


def ase_atoms(system: System):
    atoms = system.to_ase()
    atoms.calc = AseLJ(epsilon=EPS, sigma=SIGMA, rc=RC)
    return atoms


def hot_argon(seed: int = 1) -> System:
    system = argon(cells=3, rattle=0.1, seed=seed)
    rng = np.random.default_rng(seed)
    v = torch.tensor(rng.normal(scale=0.004, size=(system.n_atoms, 3)))  # Å/fs, a few hundred K
    return system.replace(fields={"velocities": v})


# ------------------------------------------------------------------- units
def test_units_match_ase():
    assert ACCELERATION == pytest.approx(units.fs**2, rel=1e-15)
    assert KINETIC * ACCELERATION == pytest.approx(1.0, rel=1e-15)
    assert KB == pytest.approx(units.kB, rel=1e-6)


# ---------------------------------------------------------------- generator
def test_splitmix64_matches_python_reference():
    rng = np.random.default_rng(0)
    xs = [0, 1, 2**63 - 1, -(2**63), -1] + [int(x) for x in rng.integers(-(2**63), 2**63 - 1, size=200)]
    got = splitmix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    mask = (1 << 64) - 1
    assert [g & mask for g in got] == [_splitmix64_int(x & mask) for x in xs]
    assert _splitmix64_int(0) == 0xE220A8397B1DCDAF  # first output of the published SplitMix64 from seed 0


def test_gaussian_is_keyed_by_id_not_by_position():
    ids = torch.arange(1000)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(3))
    full = gaussian(7, 12, ids, 3, stream=LANGEVIN)
    assert torch.equal(gaussian(7, 12, ids[perm], 3, stream=LANGEVIN), full[perm])
    assert torch.equal(gaussian(7, 12, ids[:10], 3, stream=LANGEVIN), full[:10])
    many = torch.arange(100_000)
    base = gaussian(7, 12, many, 3, stream=LANGEVIN)
    for other in (gaussian(8, 12, many, 3, stream=LANGEVIN), gaussian(7, 13, many, 3, stream=LANGEVIN), gaussian(7, 12, many, 3, stream=2)):
        assert abs(float((other * base).mean())) < 0.01  # uncorrelated streams (5 sigma)


def test_gaussian_moments():
    z = gaussian(1, 0, torch.arange(200_000), 3)
    assert abs(float(z.mean())) < 0.005
    assert float(z.var()) == pytest.approx(1.0, abs=0.01)
    assert float((z**4).mean()) == pytest.approx(3.0, abs=0.05)  # Gaussian kurtosis
    assert abs(float((z[:, 0] * z[:, 1]).mean())) < 0.005
    u = uniform(1, 0, torch.arange(100_000), 2)
    assert 0 < float(u.min()) and float(u.max()) < 1
    # Kolmogorov-Smirnov distance to U(0, 1)
    s = torch.sort(u[:, 0]).values
    ks = float((s - torch.arange(1, len(s) + 1) / len(s)).abs().max())
    assert ks < 1.63 / math.sqrt(len(s))  # 1 % level


# ------------------------------------------------------------- velocities
def test_maxwell_boltzmann_moments_momentum_and_exact_temperature():
    n = 30_000
    masses = torch.where(torch.arange(n) % 3 == 0, 39.948, 4.0026).to(torch.float64)
    v = maxwell_boltzmann(masses, torch.arange(n), 300.0, seed=4)
    assert (masses[:, None] * v).sum(0).abs().max() < 1e-9  # zero total momentum
    ke = 0.5 * float((masses[:, None] * v * v).sum()) * KINETIC
    assert 2 * ke / ((3 * n - 3) * KB) == pytest.approx(300.0, rel=1e-12)  # exact, 3N - 3 degrees of freedom
    for m in (39.948, 4.0026):
        sel = masses == m
        ratio = float((v[sel] ** 2).mean()) * m * KINETIC / (KB * 300.0)
        assert ratio == pytest.approx(1.0, abs=0.03)  # <v²> = kB T / m per component
    raw = maxwell_boltzmann(masses, torch.arange(n), 300.0, seed=4, zero_momentum=False, exact=False)
    assert not torch.allclose(raw, v)


# ---------------------------------------------------------- velocity Verlet
@pytest.mark.timeout(60)
def test_velocity_verlet_matches_ase():
    from ase.md.verlet import VelocityVerlet as AseVV

    system = hot_argon()
    record = Record(10)
    potential = Pipeline([LennardJones(EPS, SIGMA, RC)], config=DomainConfig(skin=0.3))
    sim = Simulation(potential, system, VelocityVerlet(2.0), reporters=[record])
    sim.run(60)
    atoms = ase_atoms(system)
    AseVV(atoms, timestep=2.0 * units.fs).run(60)
    final = sim.system()
    assert sim.sharded.rebuilds > 1
    assert np.abs(final.positions.numpy() - atoms.positions).max() < 1e-10
    assert np.abs(final.fields["velocities"].numpy() / units.fs - atoms.get_velocities()).max() < 1e-12
    assert record.rows[-1]["kinetic"] == pytest.approx(atoms.get_kinetic_energy(), rel=1e-10)
    assert record.rows[-1]["potential"] == pytest.approx(atoms.get_potential_energy(), rel=1e-10)
    dof = 3 * system.n_atoms - 3  # momentum conserved
    assert record.rows[-1]["temperature"] == pytest.approx(2 * atoms.get_kinetic_energy() / (dof * KB), rel=1e-10)


# ---------------------------------------------------------------- Langevin
def numpy_baoab(atoms, steps: int, dt: float, temperature: float, friction: float, seed: int) -> np.ndarray:
    """BAOAB written out with ASE forces and the same counter-based noise."""
    m = atoms.get_masses()[:, None]
    x = atoms.positions.copy()
    v = atoms.get_velocities() * units.fs  # Å/fs
    ids = torch.arange(len(atoms))
    acc = lambda pos: (atoms.set_positions(pos), atoms.get_forces() / m * units.fs**2)[1]  # noqa: E731
    a = acc(x)
    c1 = math.exp(-friction * dt)
    sigma = np.sqrt(units.kB * temperature / m) * units.fs  # Å/fs (ASE's kB; see the test's kB swap)
    for n in range(steps):
        v = v + 0.5 * dt * a
        x = x + 0.5 * dt * v
        v = c1 * v + math.sqrt(1 - c1 * c1) * sigma * gaussian(seed, n, ids, 3, stream=LANGEVIN).numpy()
        x = x + 0.5 * dt * v
        a = acc(x)
        v = v + 0.5 * dt * a
    return x


@pytest.mark.timeout(60)
def test_langevin_baoab_matches_numpy_reference(monkeypatch):
    import halopipe.dynamics.integrators as integrators

    monkeypatch.setattr(integrators, "KB", units.kB)  # the reference uses ASE's kB
    system = hot_argon(2)
    potential = Pipeline([LennardJones(EPS, SIGMA, RC)], config=DomainConfig(skin=0.3))
    sim = Simulation(potential, system, Langevin(2.0, temperature=300.0, friction=0.02, seed=9))
    sim.run(40)
    reference = numpy_baoab(ase_atoms(system), 40, 2.0, 300.0, 0.02, 9)
    assert np.abs(sim.system().positions.numpy() - reference).max() < 1e-10


@pytest.mark.timeout(60)
def test_langevin_ideal_gas_equipartition():
    # No forces: BAOAB's O step is an exact Ornstein-Uhlenbeck process, so <T> is the target (3N degrees of freedom).
    positions = torch.rand(400, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 30.0
    cell, pbc = torch.eye(3) * 30.0, torch.ones(3, dtype=torch.bool)
    # Random points overlap now and then; an ideal gas allows that, so the close-contact check is off.
    system = System(positions=positions, numbers=torch.full((400,), 18), cell=cell, pbc=pbc, min_distance=0.0)
    record = Record(1)
    sim = Simulation(LennardJones(0.0, 1.0, 0.5), system, Langevin(2.0, temperature=250.0, friction=0.05, seed=3), reporters=[record])
    sim.run(600)
    temps = [r["temperature"] for r in record.rows[100:]]
    assert np.mean(temps) == pytest.approx(250.0, rel=0.03)
    assert sim.integrator.dof(400) == 1200


# ------------------------------------------------------------ Nosé-Hoover
@pytest.mark.timeout(90)
def test_nose_hoover_chain_conserves_extended_energy_and_thermostats():
    system = argon(cells=3, rattle=0.05)
    record = Record(5)
    sim = Simulation(LennardJones(EPS, SIGMA, RC), system, NoseHooverChain(2.0, temperature=200.0, tdamp=40.0, chain=3), reporters=[record])
    sim.set_velocities(50.0, seed=1)
    sim.run(1500)
    conserved = np.array([r["conserved"] for r in record.rows])
    total = np.array([r["total"] for r in record.rows])
    assert np.ptp(total) > 100 * np.ptp(conserved)  # the thermostat pumps energy in; the extended energy stays put
    # Bound: measured 2.2e-5 eV/atom at dt = 2 fs (7e-6 at 1 fs, i.e. integration error, not a missing term).
    assert np.abs(conserved - conserved[0]).max() / system.n_atoms < 5e-5
    temps = np.array([r["temperature"] for r in record.rows])
    assert temps[len(temps) // 2 :].mean() == pytest.approx(200.0, rel=0.1)


# --------------------------------------------------------------------- FIRE
@pytest.mark.timeout(60)
def test_fire_relaxes_to_the_perfect_lattice():
    perfect = argon(cells=2, rattle=0.0)
    rattled = argon(cells=2, rattle=0.08, seed=4)
    fire = FIRE(timestep=2.0, fmax=1e-6)
    sim = Simulation(LennardJones(EPS, SIGMA, RC), rattled, fire)
    sim.run(2000)
    assert fire.converged and sim.step < 2000, (sim.step, fire.max_force)
    assert fire.max_force < 1e-6
    e_perfect = ase_atoms(perfect).get_potential_energy()
    assert float(sim.md.energy) == pytest.approx(e_perfect, abs=1e-9)
    shift = sim.system().positions - perfect.positions
    assert (shift - shift.mean(0)).abs().max() < 1e-5  # the lattice up to a rigid translation


@pytest.mark.timeout(30)
def test_fire_stops_at_the_step_limit():
    fire = FIRE(timestep=1.0, fmax=1e-8)
    sim = Simulation(LennardJones(EPS, SIGMA, RC), argon(cells=2, rattle=0.1, seed=2), fire)
    sim.run(7)
    assert sim.step == 7 and not fire.converged


# ------------------------------------------------------- across ranks (NHC, FIRE)
@pytest.mark.timeout(120)
def test_nose_hoover_and_fire_are_rank_count_invariant():
    kinds = ("nhc", "fire")
    single = invariance_run(kinds, 60, 400.0, 0.4)
    multi = spawn(invariance_run, 2, kinds, 60, 400.0, 0.4, timeout=100)[0]
    for kind in kinds:
        assert (multi[kind]["positions"] - single[kind]["positions"]).abs().max() < 1e-8, kind


def test_bad_parameters_are_rejected():
    with pytest.raises(ValueError, match="timestep"):
        VelocityVerlet(-1.0)
    with pytest.raises(ValueError, match="friction"):
        Langevin(1.0, 300.0, friction=0.0)
    with pytest.raises(ValueError, match="temperature"):
        NoseHooverChain(1.0, temperature=-5.0)
    with pytest.raises(ValueError, match="fmax"):
        FIRE(fmax=0.0)


def test_a_model_or_a_pipeline_drives_a_simulation():

    lj = lambda: LennardJones(EPS, SIGMA, RC)  # noqa: E731
    drivers = [lj(), Pipeline([lj()], config=DomainConfig(skin=0.3)), Pipeline([lj()], config=DomainConfig(skin=0.0))]
    finals = []
    for driver in drivers:
        sim = Simulation(driver, hot_argon(3), VelocityVerlet(2.0))
        finals.append(sim.run(10).system().positions)
    atoms = ase_atoms(hot_argon(3))
    from ase.md.verlet import VelocityVerlet as AseVV

    AseVV(atoms, timestep=2.0 * units.fs).run(10)
    for final in finals:
        assert np.abs(final.numpy() - atoms.positions).max() < 1e-10
    with pytest.raises(TypeError, match="a Model or Pipeline"):
        Simulation("lj", hot_argon(), VelocityVerlet(1.0))


def test_steps_between_reports_evaluate_forces_only_with_the_same_trajectory():
    """Energies are evaluated where a reporter reads them and at a run's end only (LAMMPS's eflag), with the same trajectory bit for bit."""
    potential = lambda: Pipeline([LennardJones(EPS, SIGMA, RC)], config=DomainConfig(skin=0.3))  # noqa: E731
    every, sparse = Record(1), Record(7)
    reference = Simulation(potential(), hot_argon(), VelocityVerlet(2.0), reporters=[every])
    sim = Simulation(potential(), hot_argon(), VelocityVerlet(2.0), reporters=[sparse])
    evaluated = []
    compute = sim.md.compute

    def spy() -> None:
        compute()
        evaluated.append(sim.md.energy is not None)

    sim.md.compute = spy
    reference.run(30)
    sim.run(30)
    assert evaluated == [True] + [n % 7 == 0 or n == 30 for n in range(1, 31)]  # the start, reports, the last step
    assert sim.sharded.rebuilds > 1
    assert torch.equal(sim.system().positions, reference.system().positions)
    assert torch.equal(sim.system().fields["velocities"], reference.system().fields["velocities"])
    assert [r["potential"] for r in sparse.rows] == [r["potential"] for r in every.rows if r["step"] % 7 == 0]
    assert float(sim.md.energy) == every.rows[-1]["potential"]
