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

import torch

from .backend import warp_module

__all__ = [
    "HalfList",
    "HalfListCache",
    "pair_list_key",
    "group_by_row",
    "rows_of_groups",
    "owned_weight",
    "uniform_scale",
    "warp_kernel",
    "launch",
]


def group_by_row(first: torch.Tensor, second: torch.Tensor, n_owned: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by their owned row ``first`` (a stable sort, only if not sorted yet) and the ``n_owned + 1`` int32 offsets."""
    if first.numel() > 1 and not bool((first[1:] >= first[:-1]).all()):
        order = torch.argsort(first, stable=True)
        first, second = first[order], second[order]
    start = torch.zeros(n_owned + 1, dtype=torch.int32, device=first.device)
    start[1:] = torch.cumsum(torch.bincount(first.long(), minlength=n_owned), 0)
    return first, second, start


def rows_of_groups(start: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The owned row of each pair of a list grouped by row with offsets ``start`` (the inverse of :func:`group_by_row`)."""
    counts = torch.diff(start)
    rows = torch.arange(counts.numel(), dtype=dtype, device=start.device)
    return torch.repeat_interleave(rows, counts, output_size=int(start[-1]) if start.numel() else 0)


class HalfList:
    """Each unordered pair once (int32 indices, as Warp kernels want).

    ``start`` (optional, ``n_owned + 1`` offsets) says that the pairs are
    grouped by their owned row ``first``: row ``a``'s pairs are
    ``start[a] .. start[a + 1]`` (see :meth:`grouped`). Given ``start``,
    ``first`` may be None: it is implied by the offsets, and made from them
    on first use (the row-grouped kernels never read it).
    """

    def __init__(self, first: torch.Tensor | None, second: torch.Tensor, start: torch.Tensor | None = None) -> None:
        if first is None and start is None:
            raise ValueError("HalfList: a list without its pairs' first rows must come grouped, with start offsets")
        self._first, self.second, self.start = first, second, start

    @property
    def first(self) -> torch.Tensor:
        """The owned row of each pair, int32."""
        if self._first is None:
            self._first = rows_of_groups(self.start, torch.int32)
        return self._first

    @staticmethod
    def from_pairs(pairs: torch.Tensor, n_owned: int, is_half: bool) -> HalfList:
        """From a view's pairs: a half list as is, or a directed owned-centred list halved.

        A directed list holds owned-owned pairs in both directions; one
        direction (``i < j``) is kept.
        """
        if not is_half:
            pairs = pairs[:, (pairs[1] >= n_owned) | (pairs[0] < pairs[1])]
        as32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
        return HalfList(as32(pairs[0]), as32(pairs[1]))

    @staticmethod
    def of_view(view) -> HalfList:
        """A view's half list: its int32 grouped form as is when it has one (no copy), else :meth:`from_pairs`."""
        grouped = view.half_pairs
        if grouped is not None:
            return HalfList(None, grouped.partners, grouped.start)
        return HalfList.from_pairs(view.pairs, view.n_owned, view.half_list)

    def grouped(self, n_owned: int) -> HalfList:
        """The same pairs grouped by owned row, with ``start`` offsets (a stable sort only if not grouped yet).

        A view's grouped list (``half_pairs``, taken as it is by
        :meth:`of_view`) already has them, so this usually costs nothing;
        otherwise one check and one prefix sum per rebuild.
        """
        if self.start is not None:
            return self
        first, second, start = group_by_row(self.first, self.second, n_owned)
        return HalfList(first.contiguous(), second.contiguous(), start)

    @property
    def n_pairs(self) -> int:
        return int(self.second.numel())


def pair_list_key(view):
    """What identifies a view's candidate list until the next rebuild: its grouped list, else its pairs tensor."""
    return view.half_pairs if view.half_pairs is not None else view.pairs


class HalfListCache:
    """A model's :class:`HalfList`, converted once per neighbour-list rebuild (keyed by the view's list it comes from).

    The key and its list are kept as one tuple and the list returned is the
    one just made or found, so threads sharing a model (one per rank in a
    test) never get each other's list.
    """

    def __init__(self) -> None:
        self._cached: tuple[object, HalfList] | None = None

    def get(self, view, one_holder: bool = False) -> HalfList:
        """The half list of ``view`` (see :meth:`HalfList.of_view`), or its one-holder list (``view.one_holder_pairs``)."""
        key = view.one_holder_pairs if one_holder else pair_list_key(view)
        cached = self._cached
        if cached is not None and cached[0] is key:
            return cached[1]
        half = HalfList(None, key.partners, key.start) if one_holder else HalfList.of_view(view)
        self._cached = (key, half)
        return half


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


PACK_IN_ORDER = True
"""Whether Warp kernels that make variable-length outputs (pair lists, halo images) write them packed in one pass on the CPU.

A CPU launch runs its threads one after another, in order, so thread ``i``
can start writing where thread ``i - 1`` stopped. On a GPU threads run at
once, so there (or with this False, as tests do to run those paths on the
CPU) the outputs are counted or slotted first and written or packed in a
second pass.
"""


def packs_in_order(device: torch.device) -> bool:
    """Whether the Warp kernels on ``device`` write variable-length outputs packed in one pass (:data:`PACK_IN_ORDER`)."""
    return PACK_IN_ORDER and device.type == "cpu"


def launch_packed(kernel, n_threads: int, device: torch.device, inputs: list, outputs: list) -> tuple[torch.Tensor, int]:
    """Launch a packing Warp kernel (``PACKED`` mode, in order on the CPU) and return each thread's start and the total.

    The kernel takes ``inputs``, then ``offsets`` (each thread's start, written),
    then ``outputs`` (written from the cursor on while within their length),
    then the one-element cursor. The total may exceed the outputs' length; the
    starts are right either way (``offsets[n_threads]`` is the total).
    """
    offsets = torch.empty(n_threads + 1, dtype=torch.int32, device=device)
    cursor = torch.zeros(1, dtype=torch.int32, device=device)
    launch(kernel, n_threads, device, [*inputs, offsets], [*outputs, cursor])
    total = int(cursor[0])
    offsets[n_threads] = total
    return offsets, total


def launch(kernel, n_pairs: int, device: torch.device, inputs: list, outputs: list) -> None:
    """Launch a Warp kernel over ``n_pairs`` threads on torch's device and stream.

    Tensors are passed zero-copy as array descriptors of the kernel's
    argument types (``(R, 3)`` rows as ``vec3d`` or ``vec3i`` arrays), after
    a check of their dtype that names the kernel and the argument (a
    descriptor carries no dtype for Warp to check at the launch); Warp arrays
    and scalars pass as they are. A descriptor instead of a ``wp.array``: a
    launch of a kernel with seven tensor arguments took 59 µs, 32 µs with
    descriptors (one AMD EPYC thread), and a tensor that requires grad gets
    no gradient buffer allocated behind it.
    """
    wp = warp_module()
    wp_device = wp.device_from_torch(device)
    stream = wp.stream_from_torch(device) if wp_device.is_cuda else None
    kinds = _argument_kinds(kernel)
    args = [_descriptor(wp, kernel, kinds, k, x) if isinstance(x, torch.Tensor) else x for k, x in enumerate((*inputs, *outputs))]
    wp.launch(kernel, dim=n_pairs, inputs=args[: len(inputs)], outputs=args[len(inputs) :], device=wp_device, stream=stream)


@functools.cache
def _argument_kinds(kernel) -> tuple:
    """Per argument of ``kernel``: ``(name, Warp dtype, torch dtype)`` of a concrete array, else ``(name, None, None)``."""
    wp = warp_module()
    kinds = []
    for arg in kernel.adj.args:
        dtype = getattr(arg.type, "dtype", None) if wp.types.is_array(arg.type) else None
        scalar = getattr(dtype, "_wp_scalar_type_", dtype)
        try:
            kinds.append((arg.label, dtype, wp.dtype_to_torch(scalar)))
        except TypeError:  # not an array, or a generic one: Warp converts and checks it
            kinds.append((arg.label, None, None))
    return tuple(kinds)


def _descriptor(wp, kernel, kinds: tuple, index: int, x: torch.Tensor):
    """Tensor ``x`` as the array descriptor of ``kernel``'s argument ``index`` (a ``wp.array`` for a generic argument)."""
    name, dtype, torch_dtype = kinds[index]
    if dtype is None:
        return wp.from_torch(x, requires_grad=False)
    if x.dtype != torch_dtype:
        raise TypeError(f"Warp kernel {kernel.key!r}: argument {name!r} takes {torch_dtype} tensors, got {x.dtype}")
    # A descriptor is an address, a shape and strides: the one made for a tensor of the same layout serves again.
    key = (x.data_ptr(), x.shape, x.stride(), x.device, dtype)
    made = _DESCRIPTORS.get(key)
    if made is None:
        if len(_DESCRIPTORS) >= _DESCRIPTORS_KEPT:
            _DESCRIPTORS.clear()
        made = wp.from_torch(x, dtype=dtype, requires_grad=False, return_ctype=True)
        made._ref = None  # Warp's reference to the tensor: kept, it would pin every tensor ever launched on
        _DESCRIPTORS[key] = made
    return made


_DESCRIPTORS: dict[tuple, object] = {}
"""Array descriptors by memory layout (:func:`_descriptor`): a step's lists and tables keep their tensors between
rebuilds, and its fresh outputs often take the memory the last step freed. Converting a tensor took ~3 µs, a
lookup ~0.5 (LJ's launch: 20 -> 6 µs of descriptors)."""
_DESCRIPTORS_KEPT = 512
