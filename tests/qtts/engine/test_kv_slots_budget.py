"""The KV slots' memory budget on a GPU another process shares (kv_slots.kv_budget_bytes)."""

from __future__ import annotations

import pytest

from qtts.engine.kv_slots import kv_budget_bytes

GIB = 1 << 30


def budget(free: float, own: float, others: float = 24, total: float = 80) -> float:
    return kv_budget_bytes(
        int(free * GIB), int(total * GIB), int(own * GIB),
        reserve=4 * GIB, others=int(others * GIB), prefix_cache=1 * GIB, fraction=0.9,
    ) / GIB  # fmt: skip


def test_the_budget_does_not_depend_on_whether_the_other_process_has_allocated_yet():
    # The talker holds 5 GiB of weights; code2wav will need 24 GiB in all.
    before = budget(free=75, own=5)  # code2wav holds nothing yet
    midway = budget(free=63, own=5)  # 12 GiB of its 24
    after = budget(free=51, own=5)  # all 24
    assert before == midway == after == pytest.approx((51 - 4 - 1) * 0.9)


def test_others_holding_more_than_they_said_are_not_counted_twice_and_alone_nothing_is_left():
    assert budget(free=45, own=5) == pytest.approx((45 - 4 - 1) * 0.9)  # others hold 30 of the 24 they said
    assert budget(free=75, own=5, others=0) == pytest.approx((75 - 4 - 1) * 0.9)
    assert budget(free=3, own=5) == 0  # never negative
