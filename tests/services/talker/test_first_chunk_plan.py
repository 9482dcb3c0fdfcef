"""Which chunk plan a new stream asks for: one frame first on a light talker, the 4-frame start on
a busy one, 8 frames on a heavily loaded one; on the simulated clock of `playback_sim`, and
through the talker service."""

from __future__ import annotations

import numpy as np

from qtts.pb import talker_pb2
from qtts.streams.chunk_plan import (
    BURST_PLAN,
    BUSY_STARTING,
    BUSY_STREAMS,
    HEAVY_PLAN,
    HEAVY_STREAMS,
    ChunkPlan,
    start_plan,
)
from services.talker.admission import Admission, AdmissionConfig
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.playback_sim import Cost, simulate
from tests.services.talker.stack import eventually
from tests.services.talker.test_deadline_scheduler import poisson_load
from tests.services.talker.test_talker_service import CLONE, fake_stack

# Prefill dearer than a frame step, a 30 ms trip through code2wav (the H200 stack's shape).
COST = Cost(
    base_s=0.0043, per_stream_s=0.00004, prefill_position_s=0.000025, decode_s=0.03, prefill_step_s=0.012
)
ONE_FRAME = ChunkPlan()


def test_start_plan_is_the_default_until_the_talker_is_busy():
    assert ONE_FRAME.first == 1
    assert start_plan(0, 0) is None and start_plan(BUSY_STARTING - 1, BUSY_STREAMS - 1) is None
    assert start_plan(BUSY_STARTING, 0) == BURST_PLAN == start_plan(0, BUSY_STREAMS)
    assert BURST_PLAN.first == 4
    # Heavily loaded: 8 frames first, whatever is starting.
    assert start_plan(0, HEAVY_STREAMS - 1) == BURST_PLAN
    assert start_plan(0, HEAVY_STREAMS) == HEAVY_PLAN == start_plan(BUSY_STARTING, 4 * HEAVY_STREAMS)
    assert HEAVY_PLAN.first == 8 and HEAVY_PLAN.largest == 16


def test_the_heavy_start_buffers_a_slow_hop_and_the_next_chunks_generation():
    """At 50 ms a frame step and a 200 ms trip through code2wav (the H200 stack at c=768), the
    chunk after the first is late with the 4-frame start and on time with the 8-frame one."""
    step_s, hop_s = 0.05, 0.2

    def second_chunk_late_s(plan: ChunkPlan) -> float:
        buffered_s = plan.first * 0.08  # playback starts when the first chunk arrives
        return plan.size(1) * step_s + hop_s - buffered_s

    assert second_chunk_late_s(BURST_PLAN) > 0 > second_chunk_late_s(HEAVY_PLAN)


def _open_loop(rate: float, plan) -> list:
    sched = DeadlineScheduler(1024, 2048, admission=Admission(AdmissionConfig()), policy=DeadlinePolicy())
    out = simulate(sched, poisson_load(rate, 20, 125, 220), COST, until_s=40, plan=plan)
    return [x for x in out if x.finished_at is not None]


def test_a_light_open_loop_hears_its_first_audio_three_frame_steps_sooner():
    """5 requests/s: with the talker's choice (nearly always the one-frame start) first audio
    comes sooner at the median and the 95th percentile than with a 4-frame start for all, and no
    stream has a gap either way."""
    chosen, four = _open_loop(5, None), _open_loop(5, BURST_PLAN)
    assert len(chosen) == len(four) > 50
    for out in (chosen, four):
        assert all(x.max_underrun_s() == 0 for x in out)
    for q in (50, 95):
        assert np.percentile([x.ttfa_s for x in chosen], q) < np.percentile([x.ttfa_s for x in four], q)


def _burst(plan) -> tuple[float, int]:
    adm = Admission(
        AdmissionConfig(
            first_audio_budget_s=0, step_base_s=0.0043, step_per_stream_s=0.00004, prefill_position_s=0.000025
        )
    )
    sched = DeadlineScheduler(1024, 2048, admission=adm)
    out = simulate(
        sched, [(i * 1e-6, 125, 220) for i in range(256)], COST, closed_loop=256, until_s=40, plan=plan
    )
    done = [x for x in out if x.finished_at is not None]
    assert len(done) == 512
    return float(np.median([x.ttfa_s for x in done])), sum(x.max_underrun_s() > 0 for x in done)


def test_a_burst_starts_with_four_frames_where_one_frame_for_all_would_crawl():
    """256 closed-loop streams at once: a one-frame start for every stream leaves hundreds of
    young streams with 80 ms of audio, and several of them gap (8 here; 34 before the step model's
    figures were trimmed means, which let fewer in during the burst). The talker's choice
    gives the burst the 4-frame start: first audio as soon as with that plan for all, and gaps in
    at most 2 streams (the burst's first few start with one frame). (Before admission held while
    admitted prompts wait for their prefill, the one-frame burst's first audio also came 1.8x as
    late; since, the burst is admitted as fast as it is prefilled and the gaps are the cost.)"""
    chosen, all_four, all_one = _burst(None), _burst(BURST_PLAN), _burst(ONE_FRAME)
    assert all_one[1] >= 4 * max(chosen[1], 1)
    assert chosen[0] <= 1.1 * all_four[0] and chosen[1] <= 2


async def test_a_stream_asks_its_replica_for_the_four_frame_start_while_others_start():
    """Streams whose replica grants no credit never hear audio, so they stay starting: the first
    `BUSY_STARTING` ask for the replica's default plan, the next one for the 4-frame start."""
    c2w = FakeCode2Wav("c2w-a", window=0)
    async with fake_stack([c2w], max_batch=8) as s:
        calls = []
        try:
            for i in range(BUSY_STARTING + 1):
                request = talker_pb2.GenerateRequest(request_id=f"r{i}", text="frames=100000", **CLONE)
                calls.append(s.stub.Generate(request))
                await eventually(lambda i=i: f"r{i}" in s.generator._active)
            # The replica hears the Decode calls in whatever order they arrive: by request id, once
            # every call's start message is in.
            ids = {f"r{i}" for i in range(BUSY_STARTING + 1)}
            await eventually(lambda: {log.request_id for log in c2w.logs} == ids)
            asked = {log.request_id: (log.first_chunk_frames, log.chunk_frames_ramp) for log in c2w.logs}
            assert [asked[f"r{i}"] for i in range(BUSY_STARTING)] == [(0, ())] * BUSY_STARTING
            assert asked[f"r{BUSY_STARTING}"] == (BURST_PLAN.first, BURST_PLAN.ramp)
        finally:
            for call in calls:
                call.cancel()
        await eventually(lambda: s.generator.num_active == 0)
