"""The running set's length bookkeeping (services/talker/scheduled.py): the sum and count of the
known stream lengths stay equal to a fresh scan whatever the scheduler does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from qtts.request.errors import ResourceExhausted
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler, ScheduledRequest, StreamCredit


def test_the_running_length_sums_equal_a_fresh_scan_after_random_changes():
    """`RunningStreams` keeps the sum and count of the running streams' lengths as they come and
    go (submits, admits, removes, direct inserts and deletes, a request id reused): after every
    change they, and the mean length admission uses, equal a scan of every stream."""

    rng = np.random.default_rng(18)
    s = DeadlineScheduler(max_batch=24, max_waiting=40, policy=DeadlinePolicy(frame_s=0.08))

    def random_req(rid: str) -> ScheduledRequest:
        prompt = SimpleNamespace(embeds=np.zeros((10, 1)))
        if rng.random() < 0.4:
            prompt.default_max_frames = int(rng.integers(0, 400))
        if rng.random() < 0.4:
            prompt.max_frames = int(rng.integers(0, 400))
        frames = None if rng.random() < 0.5 else int(rng.integers(0, 400))
        return ScheduledRequest(rid, prompt, None, frames, StreamCredit(10), lambda e: None)

    def scan_mean() -> float | None:
        lengths = [x for r in (*s.running.values(), *list(s.waiting)[:1]) if (x := s.forecast._length_s(r))]
        return sum(lengths) / len(lengths) if lengths else None

    now, next_id = 0.0, 0
    for _ in range(3000):
        now += 0.01
        op = rng.random()
        ids = [*s.running, *(w.request_id for w in s.waiting)]
        if op < 0.4:
            try:
                s.submit(random_req(f"r{next_id}"), now)
            except ResourceExhausted:
                pass
            next_id += 1
        elif op < 0.6:
            s.plan(now)
        elif op < 0.8 and ids:
            s.remove(str(rng.choice(ids)))
        elif op < 0.85 and s.running:
            del s.running[str(rng.choice(list(s.running)))]
        elif op < 0.9 and s.running:  # the same id again, another length
            rid = str(rng.choice(list(s.running)))
            s.running[rid] = random_req(rid)
        elif op < 0.95:
            s.running.pop("no-such-id", None)
        else:
            rid = f"direct{next_id}"
            next_id += 1
            s.running[rid] = random_req(rid)
        known = [
            f
            for r in s.running.values()
            if (
                f := r.max_new_frames
                or getattr(r.prompt, "default_max_frames", None)
                or getattr(r.prompt, "max_frames", None)
            )
        ]
        assert (s.running.length_frames, s.running.num_lengths) == (sum(known), len(known))
        fresh, kept = scan_mean(), s._mean_stream_s()
        assert (fresh is None) == (kept is None) and (
            fresh is None or kept == pytest.approx(fresh, rel=1e-12)
        )
    assert next_id > 1000 and s.num_running > 0
    s.running.clear()
    assert (s.running.length_frames, s.running.num_lengths) == (0, 0)


def test_the_kept_next_chunk_end_equals_the_plan_s_as_frames_grow_and_the_plan_changes():
    """`frames_to_next_chunk` keeps the next boundary between calls: it equals the plan's own
    `end_after` as the frames grow one or several at a time, across boundaries, and after the plan
    is replaced (a flush cuts it; a new grant brings another); `playing_slack_s` is `slack_s` and
    that slack less the next chunk's frames at the step time."""
    from qtts.streams.chunk_plan import BURST_PLAN, ChunkPlan

    rng = np.random.default_rng(7)
    req = ScheduledRequest(
        "r", SimpleNamespace(embeds=np.zeros((4, 1))), None, None, StreamCredit(8), lambda e: None
    )
    assert req.frames_to_next_chunk() == 1  # no plan yet: frame by frame
    req.chunk_plan = ChunkPlan()
    req.first_audio_at, req.delivered_s = 0.0, 2.0
    checked = 0
    for _ in range(400):
        req.credit.generated += int(rng.integers(0, 4))
        if rng.random() < 0.05:
            req.chunk_plan = req.chunk_plan.flushed(req.credit.generated)
        elif rng.random() < 0.03:
            req.chunk_plan = BURST_PLAN if req.chunk_plan.start == 0 else ChunkPlan()
        plan, generated = req.chunk_plan, req.credit.generated
        if plan.start > generated:  # a plan replaced by one from frame 0 on: only forward moves count
            continue
        want = max(1, plan.end_after(generated) - generated)
        assert req.frames_to_next_chunk() == want
        assert req.frames_to_next_chunk() == want  # kept: the same answer without a walk
        now = float(rng.uniform(0.0, 3.0))
        slack = req.slack_s(now)
        assert req.playing_slack_s(now, 0.02) == (slack, slack - want * 0.02)
        checked += 1
    assert checked > 300


def test_hand_on_now_is_true_exactly_on_the_plan_s_boundaries():
    """`hand_on_now` (with credit left, no text arriving) is true exactly where the plan's
    `end_at_or_below` is the frames generated, as the frames grow and the plan is flushed."""
    from qtts.streams.chunk_plan import ChunkPlan

    rng = np.random.default_rng(11)
    req = ScheduledRequest(
        "r", SimpleNamespace(embeds=np.zeros((4, 1))), None, None, StreamCredit(10**6), lambda e: None
    )
    assert req.hand_on_now()  # no plan yet: frame by frame
    req.chunk_plan = ChunkPlan(2, (2, 4, 8, 16))
    seen = set()
    for _ in range(500):
        req.credit.generated += int(rng.integers(0, 3))
        req.frames_to_next_chunk()  # the scheduler's pass in between, as in a step
        if rng.random() < 0.04:
            req.chunk_plan = req.chunk_plan.flushed(req.credit.generated)
        want = req.chunk_plan.end_at_or_below(req.credit.generated) == req.credit.generated
        assert req.hand_on_now() == want
        seen.add(want)
    assert seen == {True, False}
