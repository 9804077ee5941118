"""The scratch pool hands back the memory given to it, and grows new buffers with room to spare."""

from __future__ import annotations

import torch

from halopipe.scratch import ScratchPool


def test_a_scratch_pool_hands_back_given_buffers_and_grows_new_ones() -> None:
    pool = ScratchPool(keep=1)
    first = pool.take_flat(800, torch.int64, "cpu")
    assert first.numel() >= 800  # an eighth more than asked, for requests that wander
    pool.give_flat(first)
    again = pool.take_flat(850, torch.int64, "cpu")
    assert again.data_ptr() == first.data_ptr()  # the same memory, not a fresh allocation
    larger = pool.take_flat(2000, torch.int64, "cpu")  # nothing long enough is free
    assert larger.numel() >= 2000 and larger.data_ptr() != first.data_ptr()
    pool.give_flat(again)
    pool.give_flat(larger)  # keep=1: only the longest stays
    assert pool.take_flat(10, torch.int64, "cpu").data_ptr() == larger.data_ptr()
    assert pool.take_flat(10, torch.int64, "cpu").data_ptr() not in (first.data_ptr(), larger.data_ptr())
