"""SlotScheduler: admission over dense slots, chunked prefill budget, skip, cancel, move composition."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qtts.engine.kv_slots import DenseSlotTable
from qtts.engine.sequence import SeqStatus, Sequence
from qtts.engine.slot_scheduler import KVMove, SlotScheduler, compose_moves


def seq(rid: str, prompt_len: int, max_frames: int = 10, prefix_key: str | None = None) -> Sequence:
    prompt = SimpleNamespace(embeds=torch.zeros(prompt_len, 4))
    return Sequence(
        rid,
        prompt,
        sampling=None,
        seed=0,
        max_frames=max_frames,
        cap_reason="length",
        prefix_key=prefix_key,
        prefix_len=3 if prefix_key else 0,
    )


def run_prefill(s: SlotScheduler, skip=frozenset(), lookup=None):
    plan = s.schedule(lookup)
    s.mark_prefilled(plan)
    s.decode_rows(plan, skip)
    return plan


def test_admits_while_slots_free_then_waits():
    s = SlotScheduler(DenseSlotTable(num_slots=2, max_len=64), max_prefill_tokens=1000)
    for i in range(3):
        s.add(seq(f"r{i}", 5))
    plan = run_prefill(s)
    assert [c.seq.request_id for c in plan.prefills] == ["r0", "r1"]
    assert [q.request_id for q in plan.started] == ["r0", "r1"]
    assert [q.request_id for q in plan.decode] == ["r0", "r1"] and plan.num_rows == 2
    assert [q.request_id for q in s.waiting] == ["r2"] and s.num_active == 3


def test_prefill_budget_chunks_long_prompts_and_leaves_last_position_to_decode():
    s = SlotScheduler(DenseSlotTable(num_slots=4, max_len=64), max_prefill_tokens=8)
    a, b = seq("a", 13), seq("b", 4)
    s.add(a)
    s.add(b)
    p1 = run_prefill(s)
    assert [(c.seq.request_id, c.start, c.end) for c in p1.prefills] == [("a", 0, 8)]
    assert a.status is SeqStatus.PREFILLING and p1.decode == [] and p1.num_rows == 2
    p2 = run_prefill(s)
    # a needs positions 8..11 (its 13th position is the first decode input), then b gets the rest.
    assert [(c.seq.request_id, c.start, c.end) for c in p2.prefills] == [("a", 8, 12), ("b", 0, 3)]
    assert [q.request_id for q in p2.decode] == ["a", "b"]
    assert a.next_position == 12 and b.next_position == 3


def test_skip_leaves_rows_out_of_the_decode():
    s = SlotScheduler(DenseSlotTable(num_slots=4, max_len=64), max_prefill_tokens=100)
    for r in "abc":
        s.add(seq(r, 3))
    plan = run_prefill(s, skip={"b"})
    assert [q.request_id for q in plan.decode] == ["a", "c"] and plan.num_rows == 3


def test_cancel_frees_slot_and_next_plan_carries_the_move():
    s = SlotScheduler(DenseSlotTable(num_slots=4, max_len=64), max_prefill_tokens=100)
    for r in "abc":
        s.add(seq(r, 3))
    run_prefill(s)
    s.get("c").num_frames = 2
    assert s.cancel("a").finish_reason == "cancelled"
    assert s.cancel("zzz") is None
    plan = run_prefill(s)
    assert plan.moves == [KVMove(src=2, dst=0, num_positions=2 + 2)]
    assert s.get("c").slot == 0 and s.get("b").slot == 1


def test_cancel_waiting_request_and_too_long_request():
    s = SlotScheduler(DenseSlotTable(num_slots=1, max_len=16), max_prefill_tokens=100)
    s.add(seq("a", 3))
    s.add(seq("b", 3))
    run_prefill(s)
    assert s.cancel("b") is not None and not s.waiting
    with pytest.raises(ValueError):
        s.add(seq("c", 10, max_frames=10))


def test_prefix_lookup_skips_cached_positions():
    s = SlotScheduler(DenseSlotTable(num_slots=2, max_len=64), max_prefill_tokens=100)
    s.add(seq("a", 10, prefix_key="voice"))
    plan = run_prefill(s, lookup=lambda q: 3)
    assert [q.request_id for q in plan.prefix_hits] == ["a"]
    assert [(c.start, c.end) for c in plan.prefills] == [(3, 9)]


def test_compose_moves_follows_chains_and_drops_departed():
    # 9 -> 3, then the sequence in 8 moves into 5, then the one now in 3 moves on to 1.
    moves = [KVMove(9, 3, 7), KVMove(8, 5, 4), KVMove(3, 1, 7)]
    assert sorted(compose_moves(moves, num_used=6), key=lambda m: m.dst) == [KVMove(9, 1, 7), KVMove(8, 5, 4)]
    # The sequence that moved into 3 left while in the last slot: its move is dropped.
    assert compose_moves([KVMove(9, 3, 7)], num_used=3) == []


def test_compose_moves_matches_sequential_application():
    import random

    rng = random.Random(1)
    for _ in range(200):
        table = DenseSlotTable(num_slots=12, max_len=8)
        keys = [f"k{i}" for i in range(12)]
        for k in keys:
            table.allocate(k)
        state = list(keys)  # what each slot holds, applied move by move
        moves = []
        for k in rng.sample(keys, rng.randint(1, 11)):
            m = table.free(k)
            if m is not None:
                moves.append(KVMove(m.src, m.dst, 1))
        for m in moves:
            state[m.dst] = state[m.src]
        batched = list(keys)
        for m in compose_moves(moves, table.num_used):
            batched[m.dst] = keys[m.src]
        n = table.num_used
        assert state[:n] == batched[:n] == [table.owner(i) for i in range(n)]


def test_move_length_counts_frames_recorded_after_the_free():
    # Within one step's output, an earlier row can finish (freeing its slot and moving the last
    # sequence) before the moved sequence's frame of this step is counted.
    s = SlotScheduler(DenseSlotTable(num_slots=2, max_len=64), max_prefill_tokens=100)
    a, b = seq("a", 5), seq("b", 5)
    s.add(a)
    s.add(b)
    run_prefill(s)
    s.finish(a, "stop")
    b.num_frames += 1
    plan = run_prefill(s)
    assert plan.moves == [KVMove(src=1, dst=0, num_positions=4 + 1)]
