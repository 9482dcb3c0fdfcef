"""Which chunk plan a new stream asks for: one frame first on a light talker, the 4-frame start on
a busy one, 8 frames on a heavily loaded one; on the simulated clock of `playback_sim`, and
through the talker service."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from benchmarks.loadgen import LengthDistribution
from qtts.pb import talker_pb2
from qtts.request.errors import InvalidArgument
from qtts.streams.chunk_plan import (
    BURST_PLAN,
    BURST_STARTING,
    BUSY_STARTING,
    BUSY_STREAMS,
    DEFAULT_START_POLICY,
    HEAVY_PLAN,
    HEAVY_STREAMS,
    STEADY_PLAN,
    ChunkPlan,
    StartPlanner,
    StartPolicy,
)
from services.talker.admission import Admission, AdmissionConfig
from services.talker.config import TalkerConfig, config_from_args
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler
from tests.services.talker.fakes import FakeBundle, FakeCode2Wav, FakeGenerator, FakeSpec
from tests.services.talker.playback_sim import Cost, simulate
from tests.services.talker.stack import eventually, talker_stack
from tests.services.talker.test_deadline_scheduler import poisson_load
from tests.services.talker.test_talker_service import CLONE, fake_stack

# Prefill dearer than a frame step, a 30 ms trip through code2wav (the H200 stack's shape).
COST = Cost(
    base_s=0.0043, per_stream_s=0.00004, prefill_position_s=0.000025, decode_s=0.03, prefill_step_s=0.012
)
ONE_FRAME = ChunkPlan()


def test_start_plan_is_the_default_until_the_talker_is_busy():
    assert ONE_FRAME.first == 1
    assert (
        DEFAULT_START_POLICY.plan(0, 0) is None
        and DEFAULT_START_POLICY.plan(BUSY_STARTING - 1, BUSY_STREAMS - 1) is None
    )
    # Busy: two frames first, from a few streams starting or a steady load generating.
    assert (
        DEFAULT_START_POLICY.plan(BUSY_STARTING, 0)
        == STEADY_PLAN
        == DEFAULT_START_POLICY.plan(0, BUSY_STREAMS)
    )
    assert STEADY_PLAN.first == 2 and STEADY_PLAN.required_speedup() <= 1.5
    # A burst starting at once: four frames first.
    assert DEFAULT_START_POLICY.plan(BURST_STARTING - 1, HEAVY_STREAMS - 1) == STEADY_PLAN
    assert DEFAULT_START_POLICY.plan(BURST_STARTING, 0) == BURST_PLAN
    assert BURST_PLAN.first == 4
    # Heavily loaded: 8 frames first, whatever is starting.
    assert (
        DEFAULT_START_POLICY.plan(0, HEAVY_STREAMS)
        == HEAVY_PLAN
        == DEFAULT_START_POLICY.plan(BURST_STARTING, 4 * HEAVY_STREAMS)
    )
    assert HEAVY_PLAN.first == 8 and HEAVY_PLAN.largest == 16


def test_the_start_plan_thresholds_are_the_talker_s_flags_and_zero_turns_one_off():
    c = config_from_args(
        [
            "--start-plan-busy-starting",
            "8",
            "--start-plan-busy-streams",
            "0",
            "--start-plan-burst-starting",
            "100",
            "--start-plan-heavy-streams",
            "0",
        ]
    )
    policy = c.start_policy
    assert policy == StartPolicy(busy_starting=8, busy_streams=0, burst_starting=100, heavy_streams=0)
    assert policy.plan(7, 10_000) is None  # no count of streams makes it busy, none heavy
    assert policy.plan(8, 0) == STEADY_PLAN and policy.plan(100, 10_000) == BURST_PLAN
    assert config_from_args([]).start_policy == StartPolicy()
    with pytest.raises(InvalidArgument, match="--start-plan-burst-starting must be >= 0"):
        TalkerConfig(start_plan_burst_starting=-1).validate()


def test_the_start_plan_margin_is_a_flag_the_planner_checks_with():
    """`--start-plan-margin`: steps of 30 ms and trips of 60 ms fit the 2-frame start (2 x 30 + 60
    <= 160 ms) with 1.3 to spare, not with the default 1.6."""
    assert config_from_args([]).start_planner().margin == 1.6
    loose = config_from_args(["--start-plan-margin", "1.3"]).start_planner()
    tight = config_from_args([]).start_planner()
    for planner in (loose, tight):
        for i in range(50):
            planner.observe_step(0.03 + i * 1e-6)
            planner.observe_hop(0.06)
    assert loose.plan(BUSY_STARTING, 0) == STEADY_PLAN and not loose.moved
    assert tight.plan(BUSY_STARTING, 0) == BURST_PLAN and tight.misfits == [(2, "trip")]
    for bad in (0.9, float("nan")):
        with pytest.raises(InvalidArgument, match="--start-plan-margin must be >= 1"):
            TalkerConfig(start_plan_margin=bad).validate()


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


def test_a_burst_starts_with_four_frames():
    """256 closed-loop streams at once: the talker's choice gives the burst the 4-frame start
    (past the first few, which start with one or two frames): first audio as soon as with that
    plan for all, and gaps in at most 2 streams."""
    chosen, all_four = _burst(None), _burst(BURST_PLAN)
    assert chosen[0] <= 1.1 * all_four[0] and chosen[1] <= 2


# An H100's costs in the stack (d99e487): frame step 5.4 ms + 33 us a stream, prefill 5.6 us a
# position plus 4 ms a step, a 30 ms trip through code2wav.
H100_COST = Cost(
    base_s=0.0054, per_stream_s=0.000033, prefill_position_s=0.0000056, decode_s=0.03, prefill_step_s=0.004
)


def _steady_open_loop(rate: float, plan) -> tuple[float, float, float, int]:
    """The open loop of the benchmark (Poisson arrivals for 15 s, mixed 2-20 s lengths, 300-position
    prompts) on `H100_COST`: (first audio p50, p95 in seconds, share finished, streams with a gap)."""
    sched = DeadlineScheduler(1024, 2048, admission=Admission(AdmissionConfig()), policy=DeadlinePolicy())
    arrivals = poisson_load(rate, 15, 1, 300)
    frames = LengthDistribution.parse("mixed:2:20").frames(len(arrivals), seed=1)
    out = simulate(
        sched,
        [(t, n, 300) for (t, _, _), n in zip(arrivals, frames, strict=True)],
        H100_COST,
        until_s=40,
        plan=plan,
    )
    done = [x for x in out if x.finished_at is not None]
    ttfa = [x.ttfa_s for x in done]
    gaps = sum(x.max_underrun_s() > 0 for x in done)
    return float(np.percentile(ttfa, 50)), float(np.percentile(ttfa, 95)), len(done) / len(out), gaps


def test_a_steady_open_loop_starts_with_two_frames_sooner_than_with_four_and_keeps_up():
    """100 requests/s, about 150 streams generating and 7 starting at any time: the talker's
    choice (the 2-frame start) hears first audio sooner at the median and the 95th percentile
    than the 4-frame start for all (the choice for this load until 5737c78), without a gap. A
    one-frame start for all leaves the young streams less slack for the prefills: its 95th
    percentile comes later than the talker's choice (with prompts waiting up to 120 ms for
    company from a load of 0.3 it backed up to most of a second; from 0.45, about 10% later)."""
    chosen, all_four, all_one = (_steady_open_loop(100, plan) for plan in (None, BURST_PLAN, ONE_FRAME))
    assert chosen[2] == all_four[2] == 1.0 and chosen[3] == all_four[3] == 0
    assert chosen[0] < 0.85 * all_four[0] and chosen[1] < 0.9 * all_four[1]
    assert all_one[1] > chosen[1]


async def test_a_stream_asks_its_replica_for_the_two_frame_start_while_others_start():
    """Streams whose replica grants no credit never hear audio, so they stay starting: the first
    `BUSY_STARTING` ask for the replica's default plan, the next one for the 2-frame start."""
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
            assert asked[f"r{BUSY_STARTING}"] == (STEADY_PLAN.first, STEADY_PLAN.ramp)
            # Counted by the plan asked for and why (tts_talker_start_plans_total).
            registry = s.talker.metrics.registry
            counted = {
                first: registry.get_sample_value(
                    "tts_talker_start_plans_total", {"first": first, "why": "counts"}
                )
                for first in ("default", "2")
            }
            assert counted == {"default": BUSY_STARTING, "2": 1}
        finally:
            for call in calls:
                call.cancel()
        await eventually(lambda: s.generator.num_active == 0)


class GatedBundle(FakeBundle):
    """Builds each prompt only once `gate` is set (in the prompt thread): requests pile up
    waiting for their prompts, as a burst's do behind the prompt builds."""

    def __init__(self, gate: threading.Event):
        super().__init__()
        self.gate = gate

    def build_prompt(self, spec: FakeSpec):
        assert self.gate.wait(30), "the test never opened the gate"
        return super().build_prompt(spec)


async def test_requests_waiting_for_their_prompts_count_as_starting():
    """A burst's prompts are built together and their streams made one after another: the first
    stream made sees the others, still waiting for their prompts, as starting (and, once they
    have waited `BACKLOG_AGE_S`, as a backlog), so no stream of the burst asks for the one-frame
    start. (Counting only the engine's streams, the first `BUSY_STARTING` of every batch of
    builds did: on an H100 at c=768, the burst's one-frame starts were the streams that gapped.)"""
    gate = threading.Event()
    c2w = FakeCode2Wav("c2w-a", window=0)  # no credit: every stream stays starting
    n = BUSY_STARTING + 1
    ids = {f"r{i}" for i in range(n)}
    async with talker_stack(
        [c2w], bundle=GatedBundle(gate), generator_factory=FakeGenerator, spec_factory=FakeSpec, max_batch=8
    ) as s:
        calls = []
        try:
            for i in range(n):
                request = talker_pb2.GenerateRequest(request_id=f"r{i}", text="frames=100000", **CLONE)
                calls.append(s.stub.Generate(request))
            prompts = s.talker.core.prompts
            await eventually(lambda: prompts.waiting == n)
            await asyncio.sleep(2 * StartPlanner.BACKLOG_AGE_S)
            now = time.perf_counter()
            assert prompts.start_counts(now) == (n, n)  # all waiting, all past the backlog age
            gate.set()
            await eventually(lambda: {log.request_id for log in c2w.logs} == ids)
            asked = {log.request_id: (log.first_chunk_frames, log.chunk_frames_ramp) for log in c2w.logs}
            assert (0, ()) not in asked.values(), asked  # nobody asked for the replica's default
            assert prompts.waiting == 0 and prompts.start_counts(now) == (0, 0)
            registry = s.talker.metrics.registry
            moved = registry.get_sample_value(
                "tts_talker_start_plans_total", {"first": str(BURST_PLAN.first), "why": "backlog"}
            )
            assert moved and moved >= 1  # the first made saw the others' wait as a backlog
        finally:
            gate.set()
            for call in calls:
                call.cancel()
        await eventually(lambda: s.generator.num_active == 0)


def test_the_planner_takes_a_small_start_only_while_steps_and_hops_keep_it_on_time():
    """By the counts a light talker starts with one frame and a busy one with two; the recent
    steps and trips through code2wav move a start that would be late to the next larger one."""
    fast = StartPlanner()
    assert fast.plan(0, 0) is None and fast.plan(BUSY_STARTING, 0) == STEADY_PLAN  # nothing seen yet
    for i in range(50):
        fast.observe_step(0.01 + i * 1e-6)  # one step each (the chunks of a step share its time)
        fast.observe_hop(0.02)
    assert fast.plan(0, 0) is None and fast.plan(0, BUSY_STREAMS) == STEADY_PLAN
    # A 60 ms trip: one frame (80 ms) no longer covers the next frame's step and the trip.
    for _ in range(256):
        fast.observe_hop(0.06)
    assert fast.plan(0, 0) == STEADY_PLAN and fast.moved  # counted as moved by the timing
    assert fast.misfits == [(1, "trip")]  # the one-frame start, turned down by its trip
    assert fast.plan(0, BUSY_STREAMS) == STEADY_PLAN and not fast.moved  # the counts' own choice
    # A 70 ms trip with steps of 30 ms: two frames (160 ms) no longer cover the next chunk's
    # steps and the trip at the margin (2 x 30 + 70 > 160 / 1.6), four frames do (4 x 30 + 70).
    tripped = StartPlanner()
    for i in range(50):
        tripped.observe_step(0.03 + i * 1e-6)
        tripped.observe_hop(0.07)
    assert tripped.plan(0, 0) == BURST_PLAN == tripped.plan(0, BUSY_STREAMS) and tripped.why == "timing"
    assert tripped.misfits == [(2, "trip")]
    # Steps of 40 ms: too slow for the 2-frame ramp (1.43 x 40 ms > 80 / 1.6 ms).
    slow = StartPlanner()
    for i in range(50):
        slow.observe_step(0.04 + i * 1e-6)
        slow.observe_hop(0.01)
    assert slow.plan(0, 0) == BURST_PLAN and slow.misfits == [(1, "ramp"), (2, "ramp")]
    assert slow.plan(0, BUSY_STREAMS) == BURST_PLAN and slow.why == "timing"
    assert slow.misfits == [(2, "ramp")]
    # Bursts and heavy loads keep their plans whatever the steps.
    assert fast.plan(BURST_STARTING, 0) == BURST_PLAN and not fast.moved
    assert fast.plan(0, HEAVY_STREAMS) == HEAVY_PLAN and not fast.moved
    assert slow.plan(BURST_STARTING, 0) == BURST_PLAN and slow.why == "counts"
    # Ten fast steps do not hide the slow ones at the 90th percentile.
    for i in range(10):
        slow.observe_step(0.005 + i * 1e-6)
    assert slow.plan(0, 0) == BURST_PLAN
    # One slow step handing on the chunks of 300 streams counts once, not 300 times.
    once = StartPlanner()
    for _ in range(300):
        once.observe_step(0.04)
    for i in range(50):
        once.observe_step(0.01 + i * 1e-6)
        once.observe_hop(0.02)
    assert once.plan(0, 0) is None
    with pytest.raises(ValueError):
        StartPlanner(margin=0.5)


def test_a_request_behind_a_backlog_gets_no_small_start():
    """A request that arrives while others have queued (`backlog`) starts later, under whatever
    load is then: it asks for the 4-frame start however fast the recent steps were; the counts'
    larger plans stand."""
    fresh = StartPlanner()
    assert fresh.plan(0, 0, backlog=1) == BURST_PLAN and fresh.moved and fresh.why == "backlog"
    fast = StartPlanner()
    for i in range(50):
        fast.observe_step(0.01 + i * 1e-6)
        fast.observe_hop(0.02)
    assert fast.plan(0, 0) is None and fast.why == "counts"
    assert fast.plan(0, 0, backlog=3) == BURST_PLAN and fast.why == "backlog"
    assert fast.plan(0, BUSY_STREAMS, backlog=3) == BURST_PLAN and fast.why == "backlog"
    assert fast.plan(0, HEAVY_STREAMS, backlog=3) == HEAVY_PLAN and fast.why == "counts"
    slow = StartPlanner()
    for i in range(50):
        slow.observe_step(0.04 + i * 1e-6)
    assert slow.plan(0, 0, backlog=1) == BURST_PLAN and slow.why == "backlog"
    # The backlog of a queue (oldest first): its head queued `BACKLOG_AGE_S` or longer ago.
    age = StartPlanner.BACKLOG_AGE_S
    assert StartPlanner.backlog([0.0, 1.0 - age, 1.0 - age / 2, 1.0], now=1.0) == 2
    assert StartPlanner.backlog([], now=1.0) == 0
    assert slow.plan(0, 0) == BURST_PLAN and slow.why == "timing"
