import math

import numpy as np
import pytest
import torch

from halopipe import ChargeModel, Pipeline
from halopipe.neighbors import neighbor_list
from halopipe.testing import check_model

from ..conftest import cluster


def test_charges_match_independent_formula(nacl):
    model = ChargeModel(cutoff=3.5, coordination_weight=0.03, total_charge=0.5)
    out = Pipeline([model])(nacl)
    i, j, s = neighbor_list(nacl.positions, nacl.cell, nacl.pbc, 3.5)
    r = (nacl.positions[j] + s.double() @ nacl.cell - nacl.positions[i]).norm(dim=1)
    cn = torch.zeros(nacl.n_atoms, dtype=torch.float64).index_add(0, i, 0.5 * (1 + torch.cos(math.pi * r / 3.5)))
    pauling = {11: 0.93, 17: 3.16}
    raw = torch.tensor([-0.5 * (pauling[int(z)] - 2.2) for z in nacl.numbers]) - 0.03 * cn
    want = raw - (raw.sum() - 0.5) / nacl.n_atoms
    np.testing.assert_allclose(out["fields"]["charges"].numpy(), want.numpy(), atol=1e-14)
    assert float(out["fields"]["charges"].sum()) == pytest.approx(0.5, abs=1e-12)


def test_conformance_with_self_energy(nacl):
    check_model(ChargeModel(cutoff=3.5, hardness={11: 2.0, 17: 1.0}), nacl)
    check_model(ChargeModel(cutoff=3.5, hardness=1.5), cluster(20))


def test_unknown_element_is_named():
    s = cluster(6, species=(11, 92))
    with pytest.raises(ValueError, match="no electronegativity for atomic number 92"):
        Pipeline([ChargeModel()])(s)
