"""SlotScheduler: slots taken at add (no queue), chunked prefill budget, skip, cancel, move
composition, and finishing decided in `postprocess`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qtts.engine.kv_slots import DenseSlotTable
from qtts.engine.sequence import SeqStatus, Sequence
from qtts.engine.slot_scheduler import KVMove, NoFreeSlot, SlotScheduler, compose_moves
from qtts.model.step_output import SAMPLING_FAILED


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


def test_add_takes_a_slot_at_once_and_a_full_table_is_an_error():
    s = SlotScheduler(DenseSlotTable(num_slots=2, max_len=64), max_prefill_tokens=1000)
    s.add(seq("r0", 5))
    s.add(seq("r1", 5))
    assert [s.get(r).slot for r in ("r0", "r1")] == [0, 1] and s.num_free == 0 and s.num_active == 2
    assert s.get("r0").status is SeqStatus.PREFILLING
    with pytest.raises(NoFreeSlot, match="all 2 KV slots are taken"):
        s.add(seq("r2", 5))
    assert s.get("r2") is None and s.num_active == 2  # nothing waits in the slot scheduler
    plan = run_prefill(s)
    assert [c.seq.request_id for c in plan.prefills] == ["r0", "r1"]
    assert [q.request_id for q in plan.started] == ["r0", "r1"]
    assert [q.request_id for q in plan.decode] == ["r0", "r1"] and plan.num_rows == 2
    s.cancel("r0")
    s.add(seq("r2", 5))  # the freed slot is taken at once
    assert s.get("r2").slot == 1 and s.get("r1").slot == 0


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


def test_cancel_before_the_first_plan_and_too_long_request():
    s = SlotScheduler(DenseSlotTable(num_slots=2, max_len=16), max_prefill_tokens=100)
    s.add(seq("a", 3))
    s.add(seq("b", 3))
    assert s.cancel("a") is not None  # b moves into slot 0 before anything of it was written
    plan = run_prefill(s)
    assert plan.moves == [] and s.get("b").slot == 0 and [c.seq.request_id for c in plan.prefills] == ["b"]
    with pytest.raises(ValueError):
        s.add(seq("c", 10, max_frames=10))
    assert s.num_free == 1


def test_a_sequence_added_after_frees_is_moved_without_copies():
    # Frees leave moves for the next plan; a sequence added meanwhile can take (and move into) a
    # slot whose old KV belongs to a sequence that left: copying it would be wasted (or wrong).
    s = SlotScheduler(DenseSlotTable(num_slots=4, max_len=64), max_prefill_tokens=100)
    for r in "abcd":
        s.add(seq(r, 5))
    run_prefill(s)
    s.cancel("a")  # d: 3 -> 0
    s.cancel("b")  # c: 2 -> 1
    s.cancel("c")  # the last one: no move
    s.add(seq("e", 5))  # slot 1, where c's KV still is
    s.cancel("d")  # e: 1 -> 0
    s.add(seq("f", 5))  # slot 1
    plan = run_prefill(s)
    assert plan.moves == []
    assert (s.get("e").slot, s.get("f").slot) == (0, 1)
    assert [c.seq.request_id for c in plan.prefills] == ["e", "f"]
    # A running sequence's move is still planned when a new one takes the slot it left.
    s2 = SlotScheduler(DenseSlotTable(num_slots=3, max_len=64), max_prefill_tokens=100)
    for r in "xy":
        s2.add(seq(r, 5))
    run_prefill(s2)
    s2.get("y").num_frames = 3
    s2.cancel("x")  # y: 1 -> 0
    s2.add(seq("z", 5))  # slot 1, y's old slot: y's KV is copied before z's prefill writes there
    plan = run_prefill(s2)
    assert plan.moves == [KVMove(src=1, dst=0, num_positions=4 + 3)] and s2.get("z").slot == 1


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


EOS = 99


def running(num_slots: int, frames: dict[str, int]) -> SlotScheduler:
    """A scheduler with one running sequence per entry of `frames` (request id: frame bound)."""
    s = SlotScheduler(DenseSlotTable(num_slots=num_slots, max_len=64), max_prefill_tokens=100)
    for rid, max_frames in frames.items():
        s.add(seq(rid, 5, max_frames=max_frames))
    run_prefill(s)
    return s


def test_postprocess_decides_stop_sampling_failed_and_frame_bound():
    s = running(4, {"stop": 10, "broken": 10, "cap": 1, "go": 10})
    s.get("cap").cap_reason = "frame_cap"
    seqs = dict(s.running)
    rows = s.decode_rows(s.schedule())
    host = np.arange(4 * 3, dtype=np.int16).reshape(4, 3)  # row i is slot i
    host[0, 0] = EOS  # end of speech
    host[1, 2] = -1  # the sampler's INVALID_ID
    outs = s.postprocess(rows, host, EOS)
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [
        ("stop", True, "stop"),
        ("broken", True, SAMPLING_FAILED),
        ("cap", True, "frame_cap"),
        ("go", False, None),
    ]
    assert outs[0].codes is None and outs[1].codes is None
    # The rows with a frame hold views of the one host array, read by the slot at decode time.
    assert np.shares_memory(outs[2].codes, host) and outs[2].codes.tolist() == [6, 7, 8]
    assert np.shares_memory(outs[3].codes, host) and outs[3].codes.tolist() == [9, 10, 11]
    assert (s.get("go").num_frames, s.get("go").slot) == (1, 0)  # moved into a freed slot
    assert s.num_active == 1 and s.num_free == 3
    assert [seqs[r].finish_reason for r in ("stop", "broken", "cap")] == [
        "stop",
        SAMPLING_FAILED,
        "frame_cap",
    ]
    assert all(s.get(r) is None and seqs[r].status is SeqStatus.FINISHED for r in ("stop", "broken", "cap"))
    assert s.schedule().moves == [KVMove(src=3, dst=0, num_positions=4 + 1)]


def test_postprocess_counts_frames_up_to_the_bound_then_frees_the_slot():
    s = running(2, {"a": 3, "b": 10})
    a = s.get("a")
    reasons = []
    for _ in range(3):
        rows = s.decode_rows(s.schedule())
        outs = s.postprocess(rows, np.zeros((2, 4), dtype=np.int16), EOS)
        reasons.append([(o.request_id, o.finish_reason) for o in outs if o.finished])
    assert reasons == [[], [], [("a", "length")]]
    assert a.num_frames == 3 and a.finish_reason == "length" and a.slot == -1
    assert s.get("a") is None and s.get("b").num_frames == 3 and s.num_free == 1
