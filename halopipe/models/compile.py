"""Compiling the autograd-force path of ML models: the local pieces of a forward pass under ``torch.compile``.

A message-passing model on a view alternates local work (edge embeddings, each
layer's convolution and update) with halo refreshes, which communicate under
domain decomposition. With ``compile=True`` a model runs its local pieces,
"stages", through ``torch.compile`` and keeps the refreshes eager between them,
so no rank ever traces a collective and the same model file runs on 1 or N
ranks. Forces and stress are still ``-dE/dr`` and the strain derivative by
autograd: AOTAutograd compiles each stage's backward too, and the pipeline
differentiates outside the compiled regions (mace-torch's own compile path,
which differentiates inside its forward, failed under ``torch.compile`` here).

Atom, ghost and edge counts change at every rebuild. Stages are compiled with
``dynamic=True``: sizes are symbolic from the first compile, so a new count
does not recompile. A stage compiles again for a new dtype or device, for an
input whose size is 0 or 1 (dynamo specialises those), and when a count
leaves a range that a guard of the first graph assumed (seen: a view far
smaller than the first one): a few graphs per run, counted. Owned rows are
selected inside a stage by an index tensor, never by a Python integer, for
the same reason. :attr:`CompiledStages.compilations` counts the graphs
compiled, so a run can report and bound them.

A failure to compile (an operation dynamo cannot trace, no C++ compiler) warns
once, naming the cause, and the model runs eagerly from then on: never a
crash, never a silent slow path.

Stages are also where memory is traded for time: with ``checkpoint=True`` a
model's layer stages keep only their inputs for the backward pass and
recompute their activations there (``torch.utils.checkpoint``), so peak memory
holds one layer's activations instead of all of them.

``Pipeline(..., compile=True, compile_kwargs=...)`` (the seed's option) turns
compilation on for every model that has stages (MACE, SevenNet, TorchModel);
physics models (pairs, Ewald, PME, D3) run hand-written kernels and have none.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch
import torch.utils.checkpoint

__all__ = ["CompiledStages", "COMPILE_OPTIONS", "compile_models"]

COMPILE_OPTIONS = frozenset({"dynamic", "fullgraph", "mode", "options"})
"""``compile_kwargs`` accepted (those of ``torch.compile`` that keep halopipe's counting backend)."""


class CompiledStages:
    """The compiled stages of one model (off until :meth:`enable`).

    Parameters
    ----------
    owner : the model's name, for warnings.
    checkpoint : recompute the activations of stages run with ``recompute=True``
        (a model's layers) in the backward pass instead of keeping them.
    """

    def __init__(self, owner: str, checkpoint: bool = False) -> None:
        self.owner = owner
        self.checkpoint = bool(checkpoint)
        self.enabled = False
        self.options: dict = {}
        self.compilations = 0
        self.failure: str | None = None
        self._compiled: dict[str, Callable] = {}

    def enable(self, enabled: bool = True, compile_kwargs: dict | None = None) -> None:
        """Turn compilation on (or off) with ``compile_kwargs`` (a subset of :data:`COMPILE_OPTIONS`)."""
        options = dict(compile_kwargs or {})
        if options and not enabled:
            raise ValueError(f"{self.owner}: compile_kwargs were given without compile=True; add compile=True or remove them")
        unknown = sorted(set(options) - COMPILE_OPTIONS)
        if unknown:
            raise ValueError(f"{self.owner}: compile_kwargs {unknown} are not supported; use some of {sorted(COMPILE_OPTIONS)}")
        if "mode" in options and "options" in options:
            raise ValueError(f"{self.owner}: compile_kwargs may give 'mode' or 'options', not both (as torch.compile)")
        self.enabled, self.options, self._compiled = bool(enabled), options, {}

    def run(self, name: str, fn: Callable, *args, recompute: bool = False):
        """``fn(*args)``, through its compiled version when enabled (compiled at the first call of ``name``).

        With ``recompute=True`` and :attr:`checkpoint` on, the stage's
        activations are recomputed in the backward pass rather than kept.
        """
        if recompute and self.checkpoint and torch.is_grad_enabled():
            # early_stop=False: the early stop raises inside saved-tensor hooks, and TorchScript'd modules (e3nn)
            # rewrap that exception so checkpoint no longer recognises it
            return torch.utils.checkpoint.checkpoint(self._call, name, fn, *args, use_reentrant=False, early_stop=False)
        return self._call(name, fn, *args)

    def _call(self, name: str, fn: Callable, *args):
        if not self.enabled or self.failure is not None:
            return fn(*args)
        compiled = self._compiled.get(name)
        if compiled is None:
            dynamic = self.options.get("dynamic", True)
            compiled = torch.compile(
                _own_code(fn, f"{self.owner}_{name}"),
                backend=self._backend,
                dynamic=dynamic,
                fullgraph=self.options.get("fullgraph", False),
            )
            self._compiled[name] = compiled
        try:
            return compiled(*args)
        except Exception as exc:  # dynamo or inductor could not compile this stage: eager from now on
            self.failure = _cause(exc)
            warnings.warn(
                f"{self.owner}: compile=True failed in stage '{name}' ({self.failure}); running eagerly from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return fn(*args)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        """Inductor, counting each graph it is given (a first compile, a recompile, or a piece after a graph break).

        Inductor's C++ kernels are generated single-threaded (``cpp.threads``:
        1) unless ``compile_kwargs={"options": {"cpp.threads": n}}`` says
        otherwise. With two OpenMP threads, the multi-threaded kernels of a
        compiled MACE's backward corrupted the heap on a 2-core Intel host
        (torch 2.13.0: a crash at the first compiled step). At one thread per
        rank, halopipe's setting, Inductor generates the same kernels either way.
        """
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.compilations += 1
        patches = {"cpp.threads": 1}
        if "mode" in self.options:
            patches.update(list_mode_options(self.options["mode"], self.options.get("dynamic", True)))
        patches.update(self.options.get("options") or {})
        return compile_fx(graph, example_inputs, config_patches=patches)


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own, named ``name``, if it is a plain function.

    Dynamo keeps compiled graphs per code object, under a limit of a few
    entries: the stages a model builds from one function (a closure per layer)
    would share one cache, guard on the layer index, and could exhaust the
    limit, after which dynamo runs eagerly without a word.
    """
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def compile_models(models, compile_kwargs: dict | None = None) -> None:
    """Compile the stages of every model in ``models`` that has them and is not compiled already.

    A model compiled with its own ``compile_kwargs`` keeps them. Raises
    ``ValueError`` when no model has stages: ``compile=True`` would change nothing.
    """
    stages = [m.stages for m in models if isinstance(getattr(m, "stages", None), CompiledStages)]
    if not stages:
        names = ", ".join(sorted({type(m).__name__ for m in models}))
        raise ValueError(
            f"compile=True, but none of the models ({names}) has compiled stages; compilation applies to models whose forces "
            "come from autograd through a network (MACE, SevenNet, TorchModel): remove compile"
        )
    for s in stages:
        if not s.enabled:
            s.enable(True, compile_kwargs)


def _cause(exc: Exception) -> str:
    """The root cause of a compile failure in one line (dynamo wraps the backend's own error)."""
    root = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    text = " ".join(line.strip() for line in str(root).splitlines() if line.strip())
    return f"{type(root).__name__}: {text[:300]}"
