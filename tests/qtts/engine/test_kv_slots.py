"""Dense KV-slot table: allocation, frees that move the last slot into the hole, sizing."""

from __future__ import annotations

import random

import pytest

from qtts.engine.kv_slots import DenseSlotTable, SlotMove, slots_for_budget


def test_allocates_in_order_and_refuses_when_full():
    t = DenseSlotTable(num_slots=3, max_len=10)
    assert [t.allocate(k) for k in "abc"] == [0, 1, 2]
    assert t.num_free == 0 and not t.can_allocate(5)
    with pytest.raises(RuntimeError):
        t.allocate("d")
    with pytest.raises(KeyError):
        t.allocate("a")


def test_free_last_needs_no_move_free_middle_moves_last():
    t = DenseSlotTable(num_slots=4, max_len=10)
    for k in "abcd":
        t.allocate(k)
    assert t.free("d") is None
    assert t.free("a") == SlotMove(src=2, dst=0, key="c")
    assert t.slot_of("c") == 0 and t.slot_of("b") == 1 and t.num_used == 2
    assert t.allocate("e") == 2


def test_fits_and_can_allocate_respect_max_len():
    t = DenseSlotTable(num_slots=1, max_len=8)
    assert t.fits(8) and not t.fits(9) and not t.fits(0)
    assert t.can_allocate(8) and not t.can_allocate(9)


def test_random_churn_keeps_slots_dense_and_consistent():
    rng = random.Random(0)
    t = DenseSlotTable(num_slots=16, max_len=10)
    live: set[str] = set()
    for i in range(2000):
        if live and (rng.random() < 0.5 or t.num_free == 0):
            key = rng.choice(sorted(live))
            live.remove(key)
            move = t.free(key)
            if move is not None:
                assert move.dst < move.src == t.num_used
        else:
            key = f"k{i}"
            assert t.allocate(key) == len(live)
            live.add(key)
        assert sorted(t.slot_of(k) for k in live) == list(range(len(live)))
        assert all(t.owner(t.slot_of(k)) == k for k in live)


def test_slots_for_budget_counts_scratch_column_and_cap():
    assert slots_for_budget(budget_bytes=11 * 100 * 3, max_len=10, bytes_per_position=100, max_slots=8) == 3
    assert slots_for_budget(budget_bytes=10**12, max_len=10, bytes_per_position=100, max_slots=8) == 8
    assert slots_for_budget(budget_bytes=10, max_len=10, bytes_per_position=100, max_slots=8) == 0
