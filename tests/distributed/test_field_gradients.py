"""Field gradients under domain decomposition equal one process (gloo, CPU), and bad names fail on every rank."""

import pytest

from halopipe.distributed.launch import spawn

from ._field_gradient_workers import bad_name, field_gradient_cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_field_gradients_equal_one_process(world_size):
    results = spawn(field_gradient_cases, world_size, timeout=220)[0]
    assert set(results) == {"fixed", "wired"}
    for name, r in results.items():
        assert r["shape"] == (54,), (name, r)
        assert r["scale"] > 1.0, (name, r)  # a gradient worth comparing
        assert r["gradient"] < 1e-10 and r["force"] < 1e-10 and r["energy_rel"] < 1e-12, (name, r)


@pytest.mark.timeout(120)
def test_unknown_field_fails_on_every_rank():
    for message in spawn(bad_name, 2, timeout=100):
        for r in (0, 1):  # each rank found the problem itself
            assert f"rank {r}: Pipeline: field_gradients: unknown field(s) ['charge']; available fields" in message, message
        assert message.endswith("['charges']"), message
