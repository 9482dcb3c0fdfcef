"""Slot pool: static shapes, the hard bound, zeroing on allocation, idempotent and stale-safe frees."""

from __future__ import annotations

import pytest
import torch

from qtts.decode_engine.slots import SlotPool, SlotPoolFull
from qtts.request.errors import ResourceExhausted

LAYOUT = {"conv": (4, 6), "attn.k": (2, 72, 8)}


def test_buffers_have_one_padding_row_and_fixed_shapes():
    pool = SlotPool(LAYOUT, capacity=3)
    assert pool.buffers["conv"].shape == (4, 4, 6)
    assert pool.buffers["attn.k"].shape == (4, 2, 72, 8)
    assert pool.padding_slot == 3
    assert pool.slot_bytes() == (4 * 6 + 2 * 72 * 8) * 4
    assert pool.total_bytes() == 4 * pool.slot_bytes()


def test_bound_is_enforced_with_a_resource_exhausted_error():
    pool = SlotPool(LAYOUT, capacity=2)
    assert [pool.allocate(10), pool.allocate(11)] == [0, 1]
    assert pool.num_free == 0 and pool.num_used == 2
    with pytest.raises(SlotPoolFull, match="all 2 decoder state slots are in use") as info:
        pool.allocate(12)
    assert isinstance(info.value, ResourceExhausted)
    assert pool.release(0, 10)
    assert pool.allocate(12) == 0


def test_allocation_zeroes_the_slot_and_leaves_others_alone():
    pool = SlotPool(LAYOUT, capacity=2)
    a, b = pool.allocate(1), pool.allocate(2)
    for buf in pool.buffers.values():
        buf.fill_(3.0)
    pool.release(a, 1)
    assert pool.allocate(3) == a
    for buf in pool.buffers.values():
        assert torch.count_nonzero(buf[a]) == 0
        assert bool((buf[b] == 3.0).all())


def test_release_is_idempotent_and_a_stale_owner_cannot_free_a_reused_slot():
    pool = SlotPool(LAYOUT, capacity=1)
    slot = pool.allocate(1)
    assert pool.release(slot, 1) is True
    assert pool.release(slot, 1) is False
    assert pool.allocate(2) == slot
    # Stream 1's handle is stale: it neither frees nor passes the ownership check.
    assert pool.release(slot, 1) is False
    assert pool.owner(slot) == 2
    with pytest.raises(ValueError, match="freed"):
        pool.check(slot, 1)
    pool.check(slot, 2)
    with pytest.raises(ValueError, match="outside"):
        pool.release(5, 2)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        SlotPool(LAYOUT, capacity=0)
