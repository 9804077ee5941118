"""Physical validation of stochastic cell rescaling: an NaCl crystal's volume fluctuations give its bulk modulus.

In the NPT ensemble the volume fluctuates with ``<dV²> = kB T <V> kappa_T``, where ``kappa_T = 1/B_T`` is the
isothermal compressibility at the mean volume. The reference here is independent of every barostat and of the
stress: ``B = V E''(V)`` from the static energy curve of the same model (Joung-Cheatham NaCl with Ewald, 64 ions;
tests/dynamics/_nacl.py), evaluated at the run's mean volume ``<V>``, so the thermal expansion (0.25 % in volume at
30 K, which alone moves B by 1.6 %) is accounted for.

Expected systematic differences, both measured or derived, together 3 %:

* thermal: the classical quasi-harmonic free energy ``E + kB T sum ln omega_i`` at ``<V>`` gives a compressibility
  0.2 % below the static curve's at 30 K (benchmarks/nacl_compressibility.py --qha); intrinsic anharmonicity is of
  the same order in kB T / (B V / N) ~ 1e-3;
* the barostat's Euler-Maruyama step: a linear restoring force integrated with step ``a = dt / tau_eff`` gives a
  stationary variance too large by ``1 / (1 - a/2)``; here ``tau_eff = taup`` (the compressibility given is 1/B0),
  so +2.0 %.

The test passes if ``|kappa_fluct - 1/B| <= 3 sigma + 3 %``, sigma from 10 block averages of ``<dV²>``.
Measured with these settings (37 s of CPU): ratio 1.052 +- 0.121; see docs/dynamics.md, "Validation: NaCl compressibility".
A barostat whose cell noise is too large by sqrt(2) (kappa x 2), or one that ignores ``taup``, fails it.
"""

from __future__ import annotations

import pytest

from halopipe.dynamics import Simulation, StochasticCellRescaling
from halopipe.dynamics.barostats import BAR_TO_EV_PER_A3

from ._nacl import EV_PER_A3_TO_GPA, StaticCurve, compressibility_from_fluctuations, nacl_crystal, nacl_pipeline, npt_volumes

TEMPERATURE = 30.0  # K: low enough that the crystal is nearly harmonic, the thermal correction small
TIMESTEP, TAUP = 4.0, 100.0  # fs; the fastest phonon's period is 112 fs
EQUILIBRATION, STEPS = 300, 8000  # the volume's integrated correlation time is ~25 steps for <dV²>
SYSTEMATIC = 0.03  # thermal (0.2 %, rounded up to 1 %) plus the Euler step (2.0 %), relative


@pytest.fixture(scope="module")
def curve() -> StaticCurve:
    return StaticCurve(nacl_pipeline())


def test_the_model_is_a_stable_rock_salt_crystal(curve):
    """The static curve has its minimum at a sensible lattice constant and bulk modulus, and is smooth."""
    assert 5.5 < curve.lattice_constant < 5.9  # experiment: 5.60 Å at 0 K
    assert 20.0 < curve.bulk_modulus(curve.v0) * EV_PER_A3_TO_GPA < 60.0  # experiment 25 GPa; 12-power repulsion is stiffer
    assert curve.residual < 1e-6  # eV, on energies of -262 eV: the polynomial represents E(V)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_volume_fluctuations_give_the_bulk_modulus_of_the_energy_curve(curve):
    b0 = curve.bulk_modulus(curve.v0)
    integrator = StochasticCellRescaling(
        TIMESTEP, TEMPERATURE, pressure=0.0, compressibility=BAR_TO_EV_PER_A3 / b0, taup=TAUP, friction=0.01, seed=3
    )
    simulation = Simulation(nacl_pipeline(), nacl_crystal(curve.v0), integrator)
    volumes = npt_volumes(simulation, TEMPERATURE, EQUILIBRATION, STEPS)
    kappa, error = compressibility_from_fluctuations(volumes, TEMPERATURE, blocks=10)
    mean_volume = float(volumes.mean())
    expected = 1.0 / curve.bulk_modulus(mean_volume)
    print(
        f"<V> = {mean_volume:.2f} Å³ (static V0 = {curve.v0:.2f}); kappa_T = {kappa:.4f} +- {error:.4f} /(eV/Å³) "
        f"from fluctuations, {expected:.4f} from the static curve at <V> (ratio {kappa / expected:.3f} +- {error / expected:.3f})"
    )
    assert mean_volume > curve.v0, "the crystal should expand on heating"
    assert error < 0.15 * kappa, "the run is too short for a sharp check"
    assert abs(kappa - expected) <= 3 * error + SYSTEMATIC * expected
