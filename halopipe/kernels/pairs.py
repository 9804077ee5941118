"""Shared pieces of the half-list pair kernels: the list, the weights, Warp loading and launching.

A half list holds each unordered pair with an owned end once, owned end first
(:func:`halopipe.neighbors.owned_half_pairs`). A kernel adds half of each pair
energy to each end (a ghost end's half belongs to its owner, who sees the
same pair from its side, so only owned rows' energies are kept) and returns
forces ``-d(sum_i weight_i e_i)/d(rows)`` for per-row weights (1 on owned rows
and 0 on ghosts for direct forces; the incoming gradient in autograd's
backward): each pair's force carries ``(weight_a + weight_b) / 2``.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch

from .backend import warp_module

__all__ = ["HalfList", "HalfListCache", "owned_weight", "uniform_scale", "warp_kernel", "launch"]


@dataclass(frozen=True)
class HalfList:
    """Each unordered pair once (int32 indices, as Warp kernels want), with an optional per-pair type.

    ``start`` (optional, ``n_owned + 1`` offsets) says that the pairs are
    grouped by their owned row ``first``: row ``a``'s pairs are
    ``start[a] .. start[a + 1]`` (see :meth:`grouped`).
    """

    first: torch.Tensor
    second: torch.Tensor
    ptype: torch.Tensor | None = None
    start: torch.Tensor | None = None

    @staticmethod
    def from_pairs(
        pairs: torch.Tensor, n_owned: int, is_half: bool, ptype: torch.Tensor | None = None, start: torch.Tensor | None = None
    ) -> HalfList:
        """From a view's pairs: a half list as is, or a directed owned-centred list halved.

        A directed list holds owned-owned pairs in both directions; one
        direction (``i < j``) is kept. ``ptype`` (per pair of ``pairs``) is
        filtered alike. ``start``: the offsets of a half list that comes
        grouped by owned row (a view's ``pair_offsets``), kept as they are.
        """
        if not is_half:
            keep = (pairs[1] >= n_owned) | (pairs[0] < pairs[1])
            pairs, start = pairs[:, keep], None
            ptype = ptype[keep] if ptype is not None else None
        as32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
        return HalfList(as32(pairs[0]), as32(pairs[1]), as32(ptype) if ptype is not None else None, start)

    def grouped(self, n_owned: int) -> HalfList:
        """The same pairs grouped by owned row, with ``start`` offsets (a stable sort only if not grouped yet).

        The owned-centred search already returns its pairs grouped, with
        offsets that a view passes on (``pair_offsets``), so this usually costs
        nothing; without them, one check and one prefix sum per rebuild.
        """
        if self.start is not None:
            return self
        first, second, ptype = self.first, self.second, self.ptype
        if first.numel() > 1 and not bool((first[1:] >= first[:-1]).all()):
            order = torch.argsort(first, stable=True)
            first, second = first[order].contiguous(), second[order].contiguous()
            ptype = ptype[order].contiguous() if ptype is not None else None
        start = torch.zeros(n_owned + 1, dtype=torch.int32, device=first.device)
        start[1:] = torch.cumsum(torch.bincount(first.long(), minlength=n_owned), 0)
        return HalfList(first, second, ptype, start)

    @property
    def n_pairs(self) -> int:
        return int(self.first.numel())


class HalfListCache:
    """A model's :class:`HalfList`, converted once per neighbour-list rebuild.

    A view's candidate pairs are the same tensor object until the next
    rebuild, so the tensor's identity keys the cache.
    """

    def __init__(self) -> None:
        self._pairs: torch.Tensor | None = None
        self._half: HalfList | None = None

    def get(self, pairs: torch.Tensor, n_owned: int, is_half: bool) -> HalfList:
        """The half list of ``pairs`` (see :meth:`HalfList.from_pairs`)."""
        if pairs is not self._pairs:
            self._half = HalfList.from_pairs(pairs, n_owned, is_half)
            self._pairs = pairs
        return self._half


def owned_weight(rows: torch.Tensor, n_owned: int) -> torch.Tensor:
    """Weights 1 on owned rows, 0 on ghost rows (direct forces of the owned energy)."""
    weight = torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    weight[:n_owned] = 1.0
    return weight


def uniform_scale(grad: torch.Tensor) -> float | None:
    """The common value of an incoming energy gradient, or None when it varies per atom.

    The usual gradient of a sum of energies is all ones: then the forward's
    owned-weight forces, scaled, are the backward, with no second kernel pass.
    """
    if grad.numel() == 0:
        return 0.0
    first = grad[0]
    return float(first) if bool((grad == first).all()) else None


@functools.cache
def warp_kernel(name: str, source: str = "_warp_pairs"):
    """The compiled Warp kernel ``name`` of the Warp source module ``source``, or None (with a warning) when Warp cannot build it."""
    wp = warp_module()
    if wp is None:
        return None
    try:
        module = importlib.import_module(f"{__package__}.{source}")
        wp.load_module(module, device="cpu")
        return getattr(module, name)
    except Exception as exc:  # no compiler, unsupported platform: fall back, never crash
        warnings.warn(f"halopipe: Warp kernel build failed ({exc}); pair kernels run in eager torch", stacklevel=2)
        return None


def launch(kernel, n_pairs: int, device: torch.device, inputs: list, outputs: list) -> None:
    """Launch a Warp kernel over ``n_pairs`` threads on torch's device and stream.

    Tensors are passed zero-copy: ``(R, 3)`` float64 as ``vec3d`` arrays and
    ``(R, 3)`` int32 as ``vec3i``, others as they are.
    """
    wp = warp_module()
    wp_device = wp.device_from_torch(device)
    stream = wp.stream_from_torch(device) if wp_device.is_cuda else None

    def as_warp(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.ndim == 2 and x.shape[1] == 3:
            return wp.from_torch(x, dtype=wp.vec3i if x.dtype == torch.int32 else wp.vec3d)
        return wp.from_torch(x)

    inputs, outputs = [as_warp(x) for x in inputs], [as_warp(x) for x in outputs]
    wp.launch(kernel, dim=n_pairs, inputs=inputs, outputs=outputs, device=wp_device, stream=stream)
