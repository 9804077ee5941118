import itertools
import math

import numpy as np
import pytest
from scipy.special import erfc

from halopipe import DSFCoulomb, Pipeline
from halopipe.models.coulomb import COULOMB_CONSTANT
from halopipe.testing import check_model

from ..conftest import cluster


def dsf_reference(pos, q, cell, pbc, rc, alpha):
    """Fennell & Gezelter (2006) eq. 19, written out over periodic images with NumPy."""
    k = _k()
    shift = erfc(alpha * rc) / rc
    slope = erfc(alpha * rc) / rc**2 + 2 * alpha / math.sqrt(math.pi) * math.exp(-((alpha * rc) ** 2)) / rc
    energy = 0.0
    ranges = [range(-3, 4) if p else range(1) for p in pbc]
    for s in itertools.product(*ranges):
        d = pos[None, :, :] + np.array(s) @ cell - pos[:, None, :]
        r = np.linalg.norm(d, axis=2)
        m = (r > 0) & (r <= rc)
        rr = np.where(m, r, 1.0)
        energy += 0.5 * np.sum(np.where(m, q[:, None] * q[None, :] * (erfc(alpha * rr) / rr - shift + slope * (rr - rc)), 0.0)) * k
    energy -= k * (erfc(alpha * rc) / (2 * rc) + alpha / math.sqrt(math.pi)) * np.sum(q**2)
    return energy


def _k():
    """e^2 / (4 pi eps0) in eV Å from ASE's SI constants (not via Hartree*Bohr)."""
    from ase import units

    return units._e / (4 * math.pi * units._eps0) * 1e10


def test_coulomb_constant_matches_si_constants():
    assert COULOMB_CONSTANT == pytest.approx(_k(), rel=1e-12)
    assert COULOMB_CONSTANT == pytest.approx(14.3996, rel=1e-5)


@pytest.mark.parametrize("rc, alpha", [(6.0, 0.2), (9.0, 0.25), (12.0, 0.1)])
def test_matches_numpy_reference_periodic(nacl, rc, alpha):
    out = Pipeline([DSFCoulomb(rc, alpha)])(nacl)
    ref = dsf_reference(nacl.positions.numpy(), nacl.fields["charges"].numpy(), nacl.cell.numpy(), (1, 1, 1), rc, alpha)
    assert float(out["energy"]) == pytest.approx(ref, rel=1e-9)


def test_matches_numpy_reference_cluster():
    s = cluster(30)
    out = Pipeline([DSFCoulomb(8.0, 0.2)])(s)
    ref = dsf_reference(s.positions.numpy(), s.fields["charges"].numpy(), np.zeros((3, 3)), (0, 0, 0), 8.0, 0.2)
    assert float(out["energy"]) == pytest.approx(ref, rel=1e-9)


def test_conformance(nacl):
    check_model(DSFCoulomb(7.0, 0.2), nacl)
    check_model(DSFCoulomb(7.0, 0.2), cluster(24))


def test_missing_charges_is_a_clear_error(nacl):
    bare = nacl.replace(fields={})
    with pytest.raises(ValueError, match=r"lacks field\(s\) \['charges'\]"):
        Pipeline([DSFCoulomb(7.0, 0.2)])(bare)
