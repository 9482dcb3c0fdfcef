"""qtts.lru.BoundedLru: the least recently used entry goes first, under an entry bound, a cost
bound, or both."""

from __future__ import annotations

import pytest

from qtts.lru import BoundedLru


def test_the_entry_bound_evicts_the_least_recently_used():
    lru: BoundedLru[str, int] = BoundedLru(max_entries=2)
    assert lru.put("a", 1) and lru.put("b", 2)
    assert lru.get("a") == 1  # a use: "b" is now the oldest
    lru.put("c", 3)
    assert list(lru) == ["a", "c"]
    assert lru.get("b") is None and lru.get("b", -1) == -1


def test_peek_is_not_a_use():
    lru: BoundedLru[str, int] = BoundedLru(max_entries=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.peek("a") == 1
    lru.put("c", 3)
    assert "a" not in lru and list(lru) == ["b", "c"]


def test_the_cost_bound_evicts_until_the_new_entry_fits():
    lru: BoundedLru[str, bytes] = BoundedLru(max_cost=10, cost=len)
    lru.put("a", b"xxxx")
    lru.put("b", b"yyyy")
    assert lru.cost_used == 8
    lru.put("c", b"zzzzz")  # 13 > 10: "a" goes
    assert list(lru) == ["b", "c"] and lru.cost_used == 9


def test_a_value_larger_than_the_whole_budget_is_not_kept_and_drops_the_old_one():
    lru: BoundedLru[str, bytes] = BoundedLru(max_cost=4, cost=len)
    lru.put("a", b"xx")
    assert lru.put("a", b"too large") is False
    assert "a" not in lru and lru.cost_used == 0 and len(lru) == 0


def test_both_bounds_hold_at_once():
    lru: BoundedLru[str, bytes] = BoundedLru(max_entries=3, max_cost=6, cost=len)
    for key in "abcd":
        lru.put(key, b"x")
    assert list(lru) == ["b", "c", "d"]  # the entry bound
    lru.put("e", b"xxxxx")  # four entries: "b" goes; 1 + 1 + 5 > 6: "c" goes too
    assert list(lru) == ["d", "e"] and lru.cost_used == 6


def test_replacing_a_key_counts_its_cost_once_and_pop_returns_it():
    lru: BoundedLru[str, bytes] = BoundedLru(max_cost=100, cost=len)
    lru.put("a", b"xxx")
    lru.put("a", b"yy")
    assert lru.cost_used == 2 and len(lru) == 1
    assert lru.pop("a") == b"yy" and lru.cost_used == 0
    assert lru.pop("a", b"none") == b"none"


def test_zero_entries_holds_nothing_and_clear_empties():
    assert BoundedLru(max_entries=0).put("a", 1) is False
    lru: BoundedLru[str, bytes] = BoundedLru(max_entries=4, max_cost=10, cost=len)
    lru.put("a", b"abc")
    lru.clear()
    assert len(lru) == 0 and lru.cost_used == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_entries": -1}, "max_entries"),
        ({"max_cost": -1, "cost": len}, "max_cost"),
        ({"max_cost": 10}, "cost of an entry"),
    ],
)
def test_bad_bounds_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BoundedLru(**kwargs)
