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
does not recompile (a stage compiles again only for a new dtype, device or
an input whose size is 0 or 1, which dynamo specialises). Owned rows are
selected inside a stage by an index tensor, never by a Python integer, for
the same reason. :attr:`CompiledStages.compilations` counts the graphs
compiled, so a run can report and bound them.

A failure to compile (an operation dynamo cannot trace, no C++ compiler) warns
once, naming the cause, and the model runs eagerly from then on: never a
crash, never a silent slow path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["CompiledStages", "COMPILE_OPTIONS"]

COMPILE_OPTIONS = frozenset({"dynamic", "fullgraph", "mode", "options"})
"""``compile_kwargs`` accepted (those of ``torch.compile`` that keep halopipe's counting backend)."""


class CompiledStages:
    """The compiled stages of one model (off until :meth:`enable`).

    Parameters
    ----------
    owner : the model's name, for warnings.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.enabled = False
        self.options: dict = {}
        self.compilations = 0
        self.failure: str | None = None
        self._compiled: dict[str, Callable] = {}

    def enable(self, enabled: bool = True, compile_kwargs: dict | None = None) -> None:
        """Turn compilation on (or off) with ``compile_kwargs`` (a subset of :data:`COMPILE_OPTIONS`)."""
        options = dict(compile_kwargs or {})
        unknown = sorted(set(options) - COMPILE_OPTIONS)
        if unknown:
            raise ValueError(f"{self.owner}: compile_kwargs {unknown} are not supported; use some of {sorted(COMPILE_OPTIONS)}")
        if "mode" in options and "options" in options:
            raise ValueError(f"{self.owner}: compile_kwargs may give 'mode' or 'options', not both (as torch.compile)")
        self.enabled, self.options, self._compiled = bool(enabled), options, {}

    def run(self, name: str, fn: Callable, *args):
        """``fn(*args)``, through its compiled version when enabled (compiled at the first call of ``name``)."""
        if not self.enabled or self.failure is not None:
            return fn(*args)
        compiled = self._compiled.get(name)
        if compiled is None:
            dynamic = self.options.get("dynamic", True)
            compiled = torch.compile(fn, backend=self._backend, dynamic=dynamic, fullgraph=self.options.get("fullgraph", False))
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
        """Inductor, counting each graph it is given (a first compile, a recompile, or a piece after a graph break)."""
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.compilations += 1
        patches = dict(self.options.get("options") or {})
        if "mode" in self.options:
            patches.update(list_mode_options(self.options["mode"], self.options.get("dynamic", True)))
        return compile_fx(graph, example_inputs, config_patches=patches or None)


def _cause(exc: Exception) -> str:
    """The root cause of a compile failure in one line (dynamo wraps the backend's own error)."""
    root = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    text = " ".join(line.strip() for line in str(root).splitlines() if line.strip())
    return f"{type(root).__name__}: {text[:300]}"
