"""halopipe.ase.BatchCalculator: many structures served by one batched call, against one calculator each.

References: ASE's own FIRE and NEB driving halopipe's single-structure :class:`halopipe.ase.Calculator` (one per
structure or image). The batched runs must follow the same paths: the same step counts, the same positions and
energies to float64 rounding, while making one pipeline call per optimiser iteration instead of one per structure.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from ase.build import add_adsorbate, bulk, fcc100
from ase.filters import FrechetCellFilter
from ase.mep import NEB
from ase.optimize import FIRE

from halopipe import LennardJones, Pipeline
from halopipe.ase import BatchCalculator, Calculator
from halopipe.cli.relax import RelaxSettings, load_potential, relax_frames

CU = {"epsilon": {29: 0.4093}, "sigma": {29: 2.338}, "cutoff": 6.0}


def frames() -> list:
    """Rattled Cu crystals and a cluster of different sizes and cells."""
    out = []
    for k, repeat in enumerate([(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 1, 3)]):
        atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat(repeat)
        atoms.rattle(0.08, seed=k)
        out.append(atoms)
    cluster = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((2, 2, 2))[:13]
    cluster.pbc = False
    cluster.cell = None
    cluster.rattle(0.05, seed=9)
    out.append(cluster)
    return out


def ase_fire(atoms, cell: bool, fmax: float, steps: int):
    atoms = atoms.copy()
    atoms.calc = Calculator(Pipeline([LennardJones(**CU)]))
    target = FrechetCellFilter(atoms) if cell else atoms
    optimizer = FIRE(target, logfile=None)
    optimizer.run(fmax=fmax, steps=steps)
    return atoms, optimizer.nsteps


@pytest.mark.parametrize("cell", [False, True])
def test_batched_relaxation_follows_ase_fire_per_structure(tmp_path, cell):
    config = tmp_path / "cu.yaml"
    config.write_text(yaml.safe_dump({"models": {"lj": {"type": "LennardJones", **CU}}}))
    settings = RelaxSettings(fmax=0.01, steps=300, cell=cell, batch=3)
    structures = [a for a in frames() if not cell or a.pbc.all()]
    outcomes = sorted(relax_frames(structures, load_potential(config), settings), key=lambda o: o.index)
    assert [o.index for o in outcomes] == list(range(len(structures)))
    for atoms, outcome in zip(structures, outcomes):
        assert outcome.error is None, outcome.error
        reference, steps = ase_fire(atoms, cell, settings.fmax, settings.steps)
        assert outcome.converged and outcome.steps == steps, (outcome.index, outcome.steps, steps)
        np.testing.assert_allclose(outcome.atoms.positions, reference.positions, rtol=0, atol=1e-9)
        np.testing.assert_allclose(outcome.atoms.cell.array, reference.cell.array, rtol=0, atol=1e-9)
        assert outcome.energy == pytest.approx(reference.get_potential_energy(), rel=1e-12, abs=1e-12)


def test_one_pipeline_call_serves_every_structure():
    """Three structures asked in turn after one moves: one call for all, then one for the moved one alone."""
    structures = frames()[:3]
    batch = BatchCalculator(Pipeline([LennardJones(**CU)]))
    batch.attach(structures)
    energies = [a.get_potential_energy() for a in structures]
    forces = [a.get_forces() for a in structures]
    assert batch.calls == 1
    for atoms, e, f in zip(structures, energies, forces):
        alone = atoms.copy()
        alone.calc = Calculator(Pipeline([LennardJones(**CU)]))
        assert e == pytest.approx(alone.get_potential_energy(), rel=1e-13)
        np.testing.assert_allclose(f, alone.get_forces(), rtol=0, atol=1e-12)
    structures[1].positions[0] += 0.01
    structures[1].get_forces()
    structures[0].get_forces()
    assert batch.calls == 2


def neb_images(n_images: int = 7) -> list:
    """A Cu adatom hopping between two hollow sites of Cu(100), 2x2x3 slab."""
    initial = fcc100("Cu", size=(2, 2, 3), vacuum=6.0, a=3.7)
    add_adsorbate(initial, "Cu", 1.8, "hollow")
    final = initial.copy()
    final.positions[-1, 0] += initial.cell[0, 0] / 2
    images = [initial] + [initial.copy() for _ in range(n_images - 2)] + [final]
    return images


def run_neb(batched: bool, steps: int = 25) -> tuple[np.ndarray, list, int]:
    images = neb_images()
    pipeline = Pipeline([LennardJones(**CU)])
    if batched:
        batch = BatchCalculator(pipeline)
        batch.attach(images)
    else:
        for image in images:
            image.calc = Calculator(Pipeline([LennardJones(**CU)]))
    neb = NEB(images, method="improvedtangent")
    neb.interpolate()
    FIRE(neb, logfile=None).run(fmax=1e-4, steps=steps)
    energies = [image.get_potential_energy() for image in images]
    return np.array([image.positions for image in images]), energies, batch.calls if batched else -1


def test_neb_as_one_batch_per_step_equals_a_calculator_per_image():
    positions, energies, calls = run_neb(batched=True)
    ref_positions, ref_energies, _ = run_neb(batched=False)
    np.testing.assert_allclose(positions, ref_positions, rtol=0, atol=1e-9)
    np.testing.assert_allclose(energies, ref_energies, rtol=1e-12)
    assert calls <= 25 + 3  # one call per NEB step (and the end points once), not one per image
    assert max(energies) - energies[0] > 0.01  # a barrier worth comparing


def test_a_failing_structure_keeps_its_error_and_the_others_their_results():
    structures = frames()[:2]
    broken = structures[1]
    broken.numbers[0] = 47  # no LJ parameters for Ag
    batch = BatchCalculator(Pipeline([LennardJones(**CU)]))
    batch.attach(structures)
    with pytest.raises(ValueError, match="LennardJones"):
        broken.get_forces()
    assert structures[0].get_forces().shape == (len(structures[0]), 3)
