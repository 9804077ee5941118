"""``MACE(compile=True)``: compiled stages against the eager model, sizes that change without recompiling, and the
eager fallback when compiling fails."""

import pytest
import torch

from halopipe import MACE, DomainConfig, Pipeline, System

from .test_mace import build_model, make_atoms

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture
def two_threads():
    """Two intra-op threads, as torch has by default on a 2-core machine (CI runs with one)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def test_compiled_equals_eager_and_new_sizes_do_not_recompile(float32_default, two_threads):
    """A float64 model compiled as a user's script runs it, under torch's float32 default dtype and two threads,
    matches eager to rounding.

    (The compiled stages run a rebuilt copy of the model; rebuilt under a
    float32 default, its compiled results were 9e-9 relative off, its eager ones exact.
    Inductor's multi-threaded kernels of this model's backward corrupted the
    heap on a 2-core Intel host: a crash at the first compiled step.)
    """
    module = build_model("scaleshift_L2_corr3")  # float64 whatever the default
    eager = Pipeline([MACE(module)], DomainConfig(skin=0.5))
    compiled = Pipeline([MACE(module, compile=True)], DomainConfig(skin=0.5))
    stages = compiled.models[0].stages
    counts = []
    for n_side in (3, 4, 3):
        system = System.from_ase(make_atoms(True, n_side=n_side))
        want, got = eager(system, stress=True), compiled(system, stress=True)
        assert float(got["energy"]) == pytest.approx(float(want["energy"]), rel=1e-12)
        torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-10)
        torch.testing.assert_close(got["stress"], want["stress"], rtol=0, atol=1e-12)
        counts.append(stages.compilations)
    assert stages.failure is None and counts[0] > 0
    assert counts[1] == counts[0] == counts[2]  # 27 -> 64 -> 27 atoms (other ghost and edge counts): no recompile


def test_a_failing_compile_warns_once_and_runs_eagerly():
    module = build_model("scaleshift_L2_corr3")
    model = MACE(module, compile=True)

    def broken(graph, example_inputs):
        raise RuntimeError("no C++ compiler found (simulated)")

    model.stages._backend = broken
    system = System.from_ase(make_atoms(True))
    with pytest.warns(RuntimeWarning, match=r"MACE: compile=True failed in stage 'embedding' .*no C\+\+ compiler"):
        got = Pipeline([model])(system)
    want = Pipeline([MACE(module)])(system)
    torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-12)
    assert model.stages.failure is not None


def test_unknown_compile_kwargs_are_refused():
    with pytest.raises(ValueError, match=r"compile_kwargs \['backend'\] are not supported"):
        MACE(build_model("scaleshift_L2_corr3"), compile=True, compile_kwargs={"backend": "eager"})


def test_checkpointed_layers_keep_fewer_activations_and_give_the_same_numbers():
    """``checkpoint=True``: tensors saved for the backward pass (counted by a saved-tensor hook) shrink; results do not,
    eager or traced by dynamo (each layer's messages are then sums over checkpointed slices of the edges)."""
    module = build_model("scaleshift_L2_corr3")
    system = System.from_ase(make_atoms(True, n_side=3))

    def run(model) -> tuple[dict, int]:
        saved = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = Pipeline([model])(system, stress=True)
        return out, sum(saved)

    plain, plain_bytes = run(MACE(module))
    lean, lean_bytes = run(MACE(module, checkpoint=True))
    assert float(lean["energy"]) == pytest.approx(float(plain["energy"]), rel=1e-14)
    torch.testing.assert_close(lean["forces"], plain["forces"], rtol=0, atol=1e-12)
    torch.testing.assert_close(lean["stress"], plain["stress"], rtol=0, atol=1e-14)
    assert lean_bytes < 0.5 * plain_bytes, (lean_bytes, plain_bytes)
    # The sliced layers trace whole under dynamo (fullgraph raises at a graph break); its graphs run uncompiled here.
    traced = MACE(module, compile=True, checkpoint=True, compile_kwargs={"fullgraph": True})
    traced.stages._backend = lambda graph, example_inputs: graph.forward
    out = Pipeline([traced])(system, stress=True)
    assert traced.stages.failure is None, traced.stages.failure
    torch.testing.assert_close(out["forces"], plain["forces"], rtol=0, atol=1e-10)
    torch.testing.assert_close(out["stress"], plain["stress"], rtol=0, atol=1e-12)


def test_compiled_stages_are_whole_graphs_through_a_rebuilt_copy():
    """e3nn's TorchScript layers would break every graph; the rebuilt copy traces each stage whole (fullgraph=True
    makes dynamo raise at any graph break, which would show as a failure) and gives the eager model's numbers.

    Whole graphs are dynamo's finding, so its graphs run uncompiled here (CI time); what Inductor makes of the same
    stages is compared with eager above.
    """
    module = build_model("scaleshift_L2_corr3")
    model = MACE(module, compile=True, compile_kwargs={"fullgraph": True})
    graphs = []
    model.stages._backend = lambda graph, example_inputs: graphs.append(graph) or graph.forward
    system = System.from_ase(make_atoms(True, n_side=3))
    got, want = Pipeline([model])(system, stress=True), Pipeline([MACE(module)])(system, stress=True)
    assert model.stages.failure is None, model.stages.failure
    assert model.network is not module and not any(isinstance(m, torch.jit.ScriptModule) for m in model.network.modules())
    assert len(graphs) == 1 + len(module.interactions)  # the embedding and one graph per layer
    torch.testing.assert_close(got["forces"], want["forces"], rtol=0, atol=1e-10)
    torch.testing.assert_close(got["stress"], want["stress"], rtol=0, atol=1e-12)


def test_a_model_mace_cannot_rebuild_warns_and_compiles_the_original(monkeypatch):
    import mace.tools.scripts_utils as scripts_utils

    monkeypatch.setattr(scripts_utils, "extract_config_mace_model", lambda module: {"error": "Model is not a ScaleShiftMACE"})
    module = build_model("scaleshift_L2_corr3")
    model = MACE(module, compile=True)
    model.stages._backend = lambda graph, example_inputs: graph.forward  # dynamo's graphs, run uncompiled: CI time
    system = System.from_ase(make_atoms(True))
    with pytest.warns(RuntimeWarning, match=r"MACE: compile=True could not rebuild the model .*not a ScaleShiftMACE"):
        got = Pipeline([model])(system)
    assert model.network is module
    torch.testing.assert_close(got["forces"], Pipeline([MACE(module)])(system)["forces"], rtol=0, atol=1e-10)
