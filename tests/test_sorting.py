"""stable_argsort against torch's comparison sort: the same permutation, ties in input order, either side of both thresholds."""

from __future__ import annotations

import pytest
import torch

from halopipe.sorting import PAD_FROM, RADIX_SORT_MIN, stable_argsort

SIZES = [0, 1, 7, PAD_FROM - 1, PAD_FROM, 20000, RADIX_SORT_MIN - 1, RADIX_SORT_MIN, 50000]


def _with_ties(values: torch.Tensor) -> torch.Tensor:
    """A tenth of the keys repeat other keys, so the order of equal keys is tested."""
    n = values.numel() // 10
    values[:n] = values[n : 2 * n].clone()
    return values


def _reference(keys: torch.Tensor) -> torch.Tensor:
    # the comparison sort of the keys as given: floats as floats, never padded
    return torch.sort(keys, stable=True).indices


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_non_negative_floats_sort_as_floats(n, dtype):
    generator = torch.Generator().manual_seed(n)
    keys = _with_ties(torch.rand(n, generator=generator, dtype=torch.float64).to(dtype) * 12.0)
    if n > 3:
        keys[0], keys[2] = 0.0, -0.0  # equal values, different bits
        keys[1] = float("inf")
    assert torch.equal(stable_argsort(keys), _reference(keys))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("low", [0, -1000])
def test_integers_of_either_sign(n, low):
    generator = torch.Generator().manual_seed(n + 1)
    keys = _with_ties(torch.randint(low, 5000, (n,), generator=generator))
    if n > 2:
        keys[-1] = torch.iinfo(torch.int64).max  # the padding's own value: real keys still come first
    assert torch.equal(stable_argsort(keys), _reference(keys))
    assert torch.equal(stable_argsort(keys.int()), _reference(keys.int()))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("high", [2, 32767, 32768, 2**31 - 1, 2**31])
def test_integers_narrowed_to_their_range(n, high):
    """Keys that fit int16 or int32 (the padding's value included, at the bounds) sort as the int64 keys do."""
    generator = torch.Generator().manual_seed(n + high % 97)
    keys = _with_ties(torch.randint(0, high, (n,), generator=generator))
    if n > 2:
        keys[-1] = high  # the narrow type's largest value, where it fits: equal to the padding
    assert torch.equal(stable_argsort(keys), _reference(keys))
