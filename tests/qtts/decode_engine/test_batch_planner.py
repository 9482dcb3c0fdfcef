"""Batch planner: pieces, rounds, buckets, padding, first-audio priority, mapping back by stream id."""

from __future__ import annotations

import pytest

from qtts.decode_engine.batcher import BatchPlanner, PieceCollector, PlannerConfig, Row, Step, WorkItem

CAPTURED = PlannerConfig(
    chunk_sizes=(1, 2, 3, 4, 8, 16, 25),
    batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
    max_chunk_frames=72,
    max_step_frames=3200,
)


def _rows_by_stream(steps: list[Step]) -> dict[int, list[tuple[int, int, int]]]:
    """stream id -> [(round, offset, frames)] in plan order."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for s in steps:
        for r in s.rows:
            out.setdefault(r.stream_id, []).append((s.round, r.offset, s.frames))
    return out


def test_pieces_use_captured_sizes_greedily():
    p = BatchPlanner(CAPTURED)
    assert p.pieces(25) == [25]
    assert p.pieces(5) == [4, 1]
    assert p.pieces(7) == [4, 3]
    assert p.pieces(30) == [25, 4, 1]
    assert p.pieces(0) == []
    no_split = BatchPlanner(PlannerConfig(chunk_sizes=(4,), batch_sizes=(1,), split_to_captured=False))
    assert no_split.pieces(5) == [5]
    # Nothing captured (CPU): pieces only respect the attention window.
    eager = BatchPlanner(PlannerConfig(max_chunk_frames=72))
    assert eager.pieces(150) == [72, 72, 6]


def test_every_stream_is_covered_once_in_order_and_rounds_are_sequential():
    p = BatchPlanner(CAPTURED)
    items = [WorkItem(10, 30), WorkItem(11, 0), WorkItem(12, 7), WorkItem(13, 25), WorkItem(14, 2)]
    steps = p.plan(items)
    by_stream = _rows_by_stream(steps)
    assert 11 not in by_stream  # an empty chunk never becomes a row
    for it in items:
        if not it.frames:
            continue
        pieces = by_stream[it.stream_id]
        # Offsets tile the chunk with no gap or overlap, in increasing rounds.
        assert [o for _, o, _ in pieces] == [sum(f for _, _, f in pieces[:i]) for i in range(len(pieces))]
        assert sum(f for _, _, f in pieces) == it.frames
        assert [r for r, _, _ in pieces] == list(range(len(pieces)))
    assert [s.round for s in steps] == sorted(s.round for s in steps)
    for s in steps:
        ids = [r.stream_id for r in s.rows]
        assert len(set(ids)) == len(ids)  # a stream appears at most once per step


def test_groups_by_chunk_length_and_pads_to_a_captured_batch():
    p = BatchPlanner(CAPTURED)
    items = [WorkItem(i, 25) for i in range(100)] + [WorkItem(1000 + i, 4) for i in range(3)]
    steps = p.plan(items)
    assert {(s.frames, s.batch, len(s.rows), s.captured) for s in steps} == {
        (25, 128, 100, True),
        (4, 4, 3, True),
    }
    assert all(s.padding == s.batch - len(s.rows) for s in steps)


def test_large_padding_is_avoided_by_splitting_and_step_frames_are_bounded():
    p = BatchPlanner(CAPTURED)
    steps = p.plan([WorkItem(i, 4) for i in range(130)])
    assert sorted((s.batch, len(s.rows)) for s in steps) == [(2, 2), (128, 128)]
    # 200 streams of 25 frames: batch x frames <= 3200 means at most 128 rows per step.
    steps = p.plan([WorkItem(i, 25) for i in range(200)])
    assert all(s.batch * s.frames <= 3200 for s in steps)
    assert sum(len(s.rows) for s in steps) == 200


def test_padding_cheaper_than_one_more_step_keeps_a_group_in_one_step():
    p = BatchPlanner(CAPTURED)
    # 5 rows of 16 frames: 3 padding rows x 16 frames = 48 <= max_pad_frames, one step of 8.
    (step,) = p.plan([WorkItem(i, 16) for i in range(5)])
    assert (step.batch, len(step.rows)) == (8, 5)
    # 5 rows of 25 frames: 75 padded frames and 3/8 of the step: split as before.
    steps = p.plan([WorkItem(i, 25) for i in range(5)])
    assert sorted((s.batch, len(s.rows)) for s in steps) == [(1, 1), (4, 4)]
    strict = BatchPlanner(PlannerConfig(CAPTURED.chunk_sizes, CAPTURED.batch_sizes, max_pad_frames=0))
    assert len(strict.plan([WorkItem(i, 16) for i in range(5)])) == 2
    with pytest.raises(ValueError, match="max_pad_frames"):
        PlannerConfig(max_pad_frames=-1)


def test_uncaptured_lengths_run_eagerly_without_padding():
    p = BatchPlanner(PlannerConfig(chunk_sizes=(4,), batch_sizes=(8,), split_to_captured=False))
    (step,) = p.plan([WorkItem(1, 5), WorkItem(2, 5), WorkItem(3, 5)])
    assert (step.frames, step.batch, len(step.rows), step.captured) == (5, 3, 3, False)
    # Fewer rows than the smallest captured batch: padded up to it.
    (step,) = p.plan([WorkItem(1, 4)])
    assert (step.batch, step.captured) == (8, True)


def test_first_audio_goes_first_in_its_round():
    p = BatchPlanner(CAPTURED)
    steps = p.plan([WorkItem(1, 25), WorkItem(2, 8), WorkItem(3, 2, first=True)])
    assert steps[0].rows == (Row(3, 0),) and steps[0].first
    assert [s.frames for s in steps[1:]] == [8, 25]


def test_rejects_duplicates_and_negative_frames():
    p = BatchPlanner(CAPTURED)
    with pytest.raises(ValueError, match="twice"):
        p.plan([WorkItem(1, 2), WorkItem(1, 3)])
    with pytest.raises(ValueError, match="negative"):
        p.plan([WorkItem(1, -1)])
    with pytest.raises(ValueError):
        PlannerConfig(chunk_sizes=(100,), max_chunk_frames=72)
    with pytest.raises(ValueError):
        PlannerConfig(batch_sizes=(2, 2))


def test_outputs_map_back_by_stream_id_not_by_position():
    """The caller's list has an empty row first; the outputs must still land on the right streams."""
    p = BatchPlanner(CAPTURED)
    items = [WorkItem(7, 0), WorkItem(8, 5), WorkItem(9, 3)]
    collector: PieceCollector[str] = PieceCollector()
    for step in p.plan(items):
        # A fake decoder whose output names the stream and frame range it decoded.
        collector.add(step, [f"{r.stream_id}:{r.offset}+{step.frames}" for r in step.rows])
    assert collector.get(7) == []
    assert collector.get(8) == ["8:0+4", "8:4+1"]
    assert collector.get(9) == ["9:0+3"]
    with pytest.raises(ValueError, match="outputs"):
        collector.add(Step(0, 1, 2, (Row(1, 0), Row(2, 0)), True), ["only one"])
