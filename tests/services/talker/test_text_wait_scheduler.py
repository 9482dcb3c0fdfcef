"""The deadline scheduler with streams whose text is still arriving: skipped while their text has
nothing for the next frame, and their playback clock paused (never late, never behind)."""

from __future__ import annotations

import math

import torch

from qtts.model.text_feed import TextFeed
from qtts.streams.chunk_plan import ChunkPlan
from services.talker.admission import Admission, AdmissionConfig
from services.talker.deadline import DeadlineScheduler
from services.talker.generation_loop import _held_frames
from tests.services.talker.test_deadline_scheduler import req, started


def with_feed(s: DeadlineScheduler, rid: str, known: int) -> TextFeed:
    feed = TextFeed(known)
    s.running[rid].text = feed
    return feed


def test_a_stream_without_text_for_its_next_frame_is_skipped_not_ended():
    s = DeadlineScheduler(4, 0)
    for rid in "ab":
        s.submit(req(rid), now=0.0)
    s.plan(0.0)
    feed = with_feed(s, "a", known=3)
    started(s, "a", first_audio_at=0.0, generated=3)  # frames 0-2 made: frame 3 needs position 3
    started(s, "b", first_audio_at=0.0, generated=3)
    plan = s.plan(0.0)
    assert "a" in plan.skip and plan.num_text_waiting == 1 and "a" in s.running
    assert [r.request_id for r in plan.stepping] == ["b"]
    feed.append(torch.zeros(2, 4))
    plan = s.plan(0.0)
    assert plan.num_text_waiting == 0 and {r.request_id for r in plan.stepping} == {"a", "b"}
    s.running["a"].credit.generated = 5
    assert s.plan(0.0).num_text_waiting == 1
    feed.close(torch.zeros(1, 4), max_frames=40, default_max_frames=None, num_text_tokens=5)
    s.running["a"].credit.generated = 30  # closed: tts_pad follows the text, as for a whole text
    assert s.plan(0.0).num_text_waiting == 0


def test_a_listener_that_ran_dry_waiting_for_text_is_not_late_and_restarts_with_the_next_chunk():
    adm = Admission(AdmissionConfig(max_behind_fraction=0.5))
    s = DeadlineScheduler(4, 4, admission=adm)
    s.submit(req("a"), now=0.0)
    s.plan(0.0)
    r = s.running["a"]
    feed = with_feed(s, "a", known=10)
    started(s, "a", first_audio_at=0.0, generated=10)  # 0.8 s of audio handed on at t=0
    assert s.plan(0.5).num_text_waiting == 1 and r.text_waiting
    # At t=3 the listener has been dry 2.2 s: not behind (admission) while it waits.
    assert behind(s, 3.0) == (0, 0)
    feed.append(torch.zeros(5, 4))
    plan = s.plan(3.0)
    assert r.clock_restart and not r.clock_running
    # Until its next chunk it is a stream without audio: urgent, infinite slack, no lead.
    assert plan.step and [x.request_id for x in plan.stepping] == ["a"]
    assert r.slack_s(3.0) == math.inf and r.lead_s(3.0) == -math.inf and behind(s, 3.0) == (0, 0)


def test_text_that_returns_before_the_listener_runs_dry_keeps_the_clock():
    s = DeadlineScheduler(4, 0)
    s.submit(req("a"), now=0.0)
    s.plan(0.0)
    r = s.running["a"]
    feed = with_feed(s, "a", known=20)
    started(s, "a", first_audio_at=0.0, generated=20)  # 1.6 s handed on
    s.plan(0.5)
    feed.append(torch.zeros(5, 4))
    s.plan(1.0)  # 0.6 s still buffered
    assert not r.clock_restart and r.slack_s(1.0) == 1.6 - 1.0


def test_a_stream_handed_on_short_of_its_chunk_for_lack_of_text_counts_its_chunks_from_there():
    """Its session flushes the frames made so far as a chunk of their own, and code2wav cuts its
    chunks there: the engine's plan is cut at the same frame, so the deadlines count the frames
    to the next chunk from the flush, not from the old boundaries."""
    s = DeadlineScheduler(4, 0)
    s.submit(req("a"), now=0.0)
    s.plan(0.0)
    r = s.running["a"]
    r.chunk_plan = ChunkPlan(4, (8,))  # boundaries 4, 12, 20...
    r.cuts_at_flush = True  # its replica said so in its first grant
    feed = with_feed(s, "a", known=7)
    started(s, "a", first_audio_at=0.0, generated=6)
    r.held_codes = [torch.zeros(4, dtype=torch.long).numpy() for _ in range(2)]  # frames 4 and 5
    frame = _held_frames(r, 0.02)
    assert not frame.text_waiting and r.chunk_plan == ChunkPlan(4, (8,))  # frame 6 has its text
    assert r.frames_to_next_chunk() == 6
    r.credit.generated = 7
    r.held_codes = [torch.zeros(4, dtype=torch.long).numpy()]  # frame 6: the text runs dry
    frame = _held_frames(r, 0.02)
    assert frame.text_waiting and (frame.index, len(frame.codes)) == (6, 1)
    assert r.chunk_plan == ChunkPlan(4, (8,)).flushed(7) == ChunkPlan(8, (8,), start=7)
    assert r.frames_to_next_chunk() == 8  # to 15, where code2wav's next chunk ends; 5 before
    feed.append(torch.zeros(10, 4))
    r.credit.generated = 12
    r.held_codes = [torch.zeros(4, dtype=torch.long).numpy() for _ in range(5)]
    frame = _held_frames(r, 0.02)
    assert not frame.text_waiting and r.chunk_plan.start == 7 and r.frames_to_next_chunk() == 3
    # A replica that does not cut at a flush (an older one) is not flushed: the plan stays whole.
    r.chunk_plan, r.cuts_at_flush = ChunkPlan(4, (8,)), False
    r.credit.generated = 17  # the text known so far is used up
    r.held_codes = [torch.zeros(4, dtype=torch.long).numpy()]  # frame 16
    frame = _held_frames(r, 0.02)
    assert frame.text_waiting and r.chunk_plan == ChunkPlan(4, (8,)) and r.frames_to_next_chunk() == 3


def behind(s: DeadlineScheduler, now: float) -> tuple[int, int]:
    """(streams short of audio, streams with audio) as admission sees them."""
    view = s._running_view(now, 0.0)
    return view.behind, view.mature
