"""Field gradients on spawned ranks against one process (importable by child processes)."""

from __future__ import annotations

from halopipe import ChargeModel, DSFCoulomb, Ewald, Group, LennardJones, Pipeline, Step
from halopipe.distributed import DistributedError, DomainConfig

from ._composite_workers import salt
from ._workers import rank

LJ = dict(epsilon={11: 0.0115, 17: 0.0043}, sigma={11: 2.6, 17: 3.6}, cutoff=6.0)


def pipelines(config: DomainConfig) -> dict[str, tuple[Pipeline, str]]:
    """Each case: a pipeline and the field whose gradient it is asked for."""
    return {
        # The system's charges, read by a direct group (run by autograd for the call) and by Ewald.
        "fixed": (
            Pipeline(
                [Group([Step(LennardJones(**LJ)), Step(DSFCoulomb(7.0, 0.2))], autograd=False), Ewald(cutoff=6.0, accuracy=1e-6)],
                config=config,
            ),
            "charges",
        ),
        # Charges produced by ChargeModel and wired into DSF: the downstream partial dE/dq.
        "wired": (
            Pipeline(
                [
                    Group(
                        [
                            Step(ChargeModel(3.5, coordination_weight=0.05, hardness=2.0), wire={"charges": "q"}),
                            Step(DSFCoulomb(7.0, 0.2), bind={"charges": "q"}),
                        ]
                    ),
                    Group([Step(LennardJones(**LJ))], autograd=False),
                ],
                config=config,
            ),
            "q",
        ),
    }


def field_gradient_cases() -> dict | None:
    """Each case decomposed (a plain call on the system: scattered, gathered) and, on rank 0, on one process."""
    system = salt()
    config = DomainConfig(skin=0.5, timeout=60)
    results = {}
    for name, (pipeline, field) in pipelines(config).items():
        out = pipeline(system if rank() == 0 else None, field_gradients=[field])
        key = f"d_energy_d_{field}"
        if rank() != 0:
            continue
        ref = pipeline(system, decompose=False, field_gradients=[field])
        results[name] = {
            "gradient": float((out[key] - ref[key]).abs().max()),
            "scale": float(ref[key].abs().max()),
            "force": float((out["forces"] - ref["forces"]).abs().max()),
            "energy_rel": abs(float(out["energy"] - ref["energy"])) / abs(float(ref["energy"])),
            "shape": tuple(out[key].shape),
        }
    return results if rank() == 0 else None


def bad_name() -> str:
    """The error every rank raises for an unknown field (only rank 0 holds the system), agreed before the evaluation."""
    system = salt() if rank() == 0 else None
    pipeline = Pipeline([DSFCoulomb(7.0, 0.2)], config=DomainConfig(timeout=60))
    try:
        pipeline(system, field_gradients=["charge"])
    except DistributedError as error:
        return str(error)
    return "no error"
