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


def test_a_lent_buffer_comes_back_only_once_no_view_of_it_is_left() -> None:
    pool = ScratchPool(keep=2)
    lent = pool.lend_flat(1000, torch.int32, "cpu")
    address = lent.data_ptr()
    result = lent[:600]  # what a caller keeps: a view
    result.copy_(torch.arange(600, dtype=torch.int32))
    del lent
    other = pool.lend_flat(1000, torch.int32, "cpu")  # the first is still viewed: a fresh buffer
    assert other.data_ptr() != address
    other.fill_(-1)
    assert torch.equal(result, torch.arange(600, dtype=torch.int32))  # never written over while viewed
    as_numpy = result.numpy()  # memory shared with NumPy counts as a view too
    del result
    assert pool.take_flat(1000, torch.int32, "cpu").data_ptr() != address
    del as_numpy
    assert pool.take_flat(1000, torch.int32, "cpu").data_ptr() == address  # nothing refers to it now: back in the pool
