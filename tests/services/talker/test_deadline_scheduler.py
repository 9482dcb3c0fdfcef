"""The talker's deadline scheduler and capacity admission, on a simulated clock (no timings)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from qtts.request.errors import ResourceExhausted, Unavailable
from qtts.streams.chunk_plan import ChunkPlan
from services.talker.admission import Admission, AdmissionConfig, StepModel
from services.talker.config import config_from_args
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler, ScheduledRequest, StreamCredit
from services.talker.model_setup import scheduler_for
from tests.services.talker.playback_sim import Cost, _prompt, simulate


def req(rid: str, positions: int = 10, window: int = 10**6) -> ScheduledRequest:
    return ScheduledRequest(
        rid, _prompt(positions), None, None, StreamCredit(window, granted_until=10**6), lambda e: None
    )


def started(s: DeadlineScheduler, rid: str, *, first_audio_at: float, generated: int) -> ScheduledRequest:
    r = s.running[rid]
    r.stepped = True
    r.first_audio_at = first_audio_at
    r.credit.generated = generated
    r.delivered_s = generated * 0.08
    return r


def test_streams_far_ahead_pause_and_the_engine_sleeps_until_the_first_is_due():
    s = DeadlineScheduler(8, 8, policy=DeadlinePolicy(urgent_lead_s=1.0, max_lead_s=2.0))
    for rid in "abc":
        s.submit(req(rid), now=0.0)
    plan = s.plan(0.0)
    assert [r.request_id for r in plan.admitted] == ["a", "b", "c"]
    assert plan.step and len(plan.stepping) == 3  # new streams are the most urgent work
    now = 10.0
    started(s, "a", first_audio_at=now - 1.0, generated=40)  # 2.2 s ahead: paused
    started(s, "b", first_audio_at=now - 1.0, generated=30)  # 1.4 s buffered: not due yet
    started(s, "c", first_audio_at=now - 1.0, generated=27)  # 1.16 s buffered: not due yet
    plan = s.plan(now)
    assert not plan.step and plan.skip == {"a", "b", "c"} and plan.num_paused == 1
    assert plan.wake_at == pytest.approx(now + 0.16)  # c's lead falls to 1.0 s then
    plan = s.plan(now + 0.17)
    # c is due: everyone under the max lead joins the step (one wide batch), a stays paused.
    assert plan.step and {r.request_id for r in plan.stepping} == {"b", "c"} and plan.skip == {"a"}


def test_a_stream_without_credit_is_skipped_whatever_its_lead():
    s = DeadlineScheduler(4, 0)
    s.submit(req("a", window=2), now=0.0)
    s.plan(0.0)
    s.running["a"].credit.granted_until = 0
    s.running["a"].credit.generated = 2
    plan = s.plan(0.0)
    assert not plan.step and plan.skip == {"a"} and plan.num_credit_stalled == 1


def test_queue_bounds_and_draining():
    s = DeadlineScheduler(max_batch=2, max_waiting=1)
    for rid in "abc":
        s.submit(req(rid), now=0.0)
    with pytest.raises(ResourceExhausted, match="capacity"):
        s.submit(req("d"), now=0.0)
    with pytest.raises(ResourceExhausted, match="already in progress"):
        s.submit(req("a"), now=0.0)
    assert [r.request_id for r in s.plan(0.0).admitted] == ["a", "b"]
    assert s.remove("a")[1] and s.remove("a") == (None, False)
    assert [r.request_id for r in s.plan(0.0).admitted] == ["c"]
    s.admitting = False
    with pytest.raises(Unavailable, match="draining"):
        s.submit(req("e"), now=0.0)


def test_a_large_batch_first_measures_the_slope_not_the_base():
    m = StepModel(AdmissionConfig(step_base_s=0.004, step_per_stream_s=0.0))
    for _ in range(StepModel.MIN_SAMPLES):  # a window replaces the prior once it holds this many
        m.observe(200, 0.004 + 200 * 0.0001)
    assert m.base_s == 0.004 and m.per_stream_s == pytest.approx(0.0001)


def test_step_model_learns_base_and_slope():
    m = StepModel(AdmissionConfig(step_base_s=0.001, step_per_stream_s=0.0))
    for _ in range(30):
        m.observe(4, 0.010)
        m.observe(200, 0.010 + 200 * 0.0003)
    # The base is the intercept: the small batch's own four streams come off it.
    assert m.predict(4) == pytest.approx(0.010, rel=1e-3)
    assert m.predict(200) == pytest.approx(0.010 + 200 * 0.0003, rel=1e-3)
    assert m.per_stream_s == pytest.approx(0.0003, rel=0.03)
    assert m.predict(400) == pytest.approx(0.010 + 400 * 0.0003, rel=0.02)
    for _ in range(30):
        m.observe(200, m.predict(200) + 300 * 0.00002, prefill_positions=300)
    assert m.prefill_s(300) == pytest.approx(300 * 0.00002, rel=0.05)


def test_admission_refuses_at_capacity_and_admits_again_when_load_falls():
    cfg = AdmissionConfig(max_duty=0.5, step_base_s=0.0045, step_per_stream_s=0.001, first_audio_budget_s=0)
    s = DeadlineScheduler(max_batch=100, max_waiting=100, admission=Admission(cfg))
    for i in range(50):
        s.submit(req(f"r{i}"), now=0.0)
    admitted = []
    for _ in range(5):
        admitted += s.plan(0.0).admitted
    # 4.5 ms + 1 ms a stream within 40 ms (half a frame): 35 streams, never more.
    assert len(admitted) == 35 and s.num_waiting == 15
    assert "36 streams" in s.holding_reason
    for r in admitted[:10]:
        s.remove(r.request_id)
    assert len(s.plan(0.0).admitted) == 10  # load fell: the queue moves again
    assert s.num_running == 35


def test_admission_counts_the_prefills_that_replace_ending_streams():
    """Frame steps of 4 ms + 20 us a stream take 0.05 + N/4000 of the engine thread; with 10 s
    streams each replaced by a 20 ms prefill, N/500 more. Under a 0.8 load bound that is
    (0.8 - 0.05) / (1/4000 + 1/500) = 333 streams, where the step bound alone (duty 0.6) would
    have allowed about 2,200."""
    cfg = AdmissionConfig(
        max_duty=0.6,
        max_load=0.8,
        step_base_s=0.004,
        step_per_stream_s=0.00002,
        prefill_request_s=0.02,
        first_audio_budget_s=0,
    )
    adm = Admission(cfg)
    assert adm.capacity(mean_stream_s=10.0) == 333
    assert adm.capacity(mean_stream_s=20.0) == 600  # longer streams: fewer prefills a second
    s = DeadlineScheduler(max_batch=5000, max_waiting=5000, admission=adm)
    for i in range(400):
        r = req(f"r{i}")
        r.max_new_frames = 125  # 10 s
        s.submit(r, now=0.0)
    admitted = []
    for _ in range(40):
        admitted += s.plan(0.0).admitted
    assert len(admitted) == 333 and s.num_waiting == 67
    assert "busy" in s.holding_reason and "prefills" in s.holding_reason
    no_load_bound = Admission(dataclasses.replace(cfg, max_load=0))
    assert abs(no_load_bound.capacity(mean_stream_s=10.0) - 2200) <= 1  # (48 - 4) ms / 20 us


def test_a_few_short_streams_do_not_set_the_capacity_for_the_next_burst():
    """One 2 s stream on an idle talker (a probe) weighs against PRIOR_STREAMS streams of the
    default 10 s: the capacity stays near the 10 s one (333 here), not the 2 s one; a hundred
    such streams do move it, since then short streams are what the talker serves."""
    cfg = AdmissionConfig(
        max_duty=0.6, max_load=0.8, step_base_s=0.004, step_per_stream_s=0.00002, prefill_request_s=0.02
    )
    s = DeadlineScheduler(max_batch=5000, max_waiting=5000, admission=Admission(cfg))
    assert s._mean_stream_s() is None
    first = req("probe")
    first.max_new_frames = 25  # 2 s
    s.submit(first, now=0.0)
    assert s.plan(0.0).admitted == [first]
    prior = s.forecast.PRIOR_STREAMS
    mean = s._mean_stream_s()
    assert mean == pytest.approx((2.0 + prior * 10.0) / (1 + prior))
    assert s.admission.capacity(mean) >= 300 > s.admission.capacity(2.0)
    for i in range(99):
        r = req(f"short{i}")
        r.max_new_frames = 25
        s.running[r.request_id] = r
    many = s._mean_stream_s()
    assert many == pytest.approx((200.0 + prior * 10.0) / (100 + prior)) and many < 3.0


def test_the_step_model_learns_what_a_request_s_prefill_costs():
    m = StepModel(AdmissionConfig(step_base_s=0.004, step_per_stream_s=0.0, prefill_request_s=0.0))
    for _ in range(30):
        m.observe(100, 0.004 + 3 * 0.012, prefill_positions=90, prefill_requests=3)
    assert m.prefill_request_s == pytest.approx(0.012, rel=1e-3)
    assert m.prefill_s(90) == pytest.approx(0.036, rel=1e-3)


def test_new_prompts_wait_for_company_while_streams_play_and_go_at_once_on_an_idle_server():
    s = DeadlineScheduler(
        10,
        100,
        admission=Admission(AdmissionConfig(first_audio_budget_s=0)),
        policy=DeadlinePolicy(coalesce_s=0.1, coalesce_rows=3, coalesce_full_load=0),
    )
    s.submit(req("first", positions=50), now=0.0)
    plan = s.plan(0.0)
    assert plan.step and plan.prefill_budget >= 50  # nothing plays: no waiting
    started(s, "first", first_audio_at=0.0, generated=8)
    s.submit(req("a", positions=40), now=0.50)
    plan = s.plan(0.50)  # "first" is due (little buffered) and steps; a's prefill waits
    assert plan.step and plan.prefill_budget == 0 and [r.request_id for r in plan.stepping] == ["first"]
    s.submit(req("b", positions=40), now=0.55)
    assert s.plan(0.55).prefill_budget == 0
    plan = s.plan(0.61)  # the oldest waited its 100 ms: both go in one step
    assert plan.step and plan.prefill_budget >= 80 and {r.request_id for r in plan.stepping} >= {"a", "b"}
    for rid in ("a", "b"):
        started(s, rid, first_audio_at=0.7, generated=4)
    for r in s.running.values():
        r.delivered_s = 8.0  # well buffered: nobody is due, so nothing else forces a step
    s.submit(req("c", positions=40), now=1.0)
    plan = s.plan(1.0)
    assert not plan.step and plan.wake_at == pytest.approx(1.1)  # sleeps until c's wait is over
    for rid in ("d", "e"):
        s.submit(req(rid, positions=40), now=1.01)
    plan = s.plan(1.01)  # a full batch (3) does not wait
    assert plan.step and plan.prefill_budget >= 120


def test_new_prompts_wait_for_company_only_as_long_as_the_engine_load_asks():
    # Priors: a step of n streams 4.7 ms + 20 us * n, a prefill 10 ms, streams of 10 s. One
    # stream playing is a light load (about 7%): a new prompt is prefilled at once. With the
    # per-stream cost raised so that the running streams load the engine past 75%, it waits the
    # whole 100 ms for company; at 60% (between 45% and 75%), half of it. With the default loads
    # (from capacity on) neither waits.
    def scheduler(**loads: float) -> DeadlineScheduler:
        return DeadlineScheduler(
            100,
            100,
            admission=Admission(AdmissionConfig(first_audio_budget_s=0, max_load=0, max_duty=0)),
            policy=DeadlinePolicy(coalesce_s=0.1, coalesce_rows=8, **loads),
        )

    light = scheduler()
    light.submit(req("first", positions=50), now=0.0)
    light.plan(0.0)
    started(light, "first", first_audio_at=0.0, generated=8)
    light.submit(req("a", positions=40), now=0.5)
    assert light.plan(0.5).prefill_budget >= 40  # no wait

    def load_with(per_stream_s: float) -> float:  # 41 streams: the newcomer running too
        return (0.0047 + 41 * per_stream_s) / 0.08 + 41 * 0.01 / 10

    half_way = ((0.60 - 41 * 0.01 / 10) * 0.08 - 0.0047) / 41
    scaled = {"coalesce_from_load": 0.45, "coalesce_full_load": 0.75}
    for per_stream_s, wait_s, loads in ((0.0016, 0.1, scaled), (half_way, 0.05, scaled), (half_way, 0.0, {})):
        busy = scheduler(**loads)
        busy.admission.model.per_stream_s = per_stream_s
        for k in range(40):
            busy.submit(req(f"r{k}", positions=10), now=0.0)
        while busy.num_waiting:
            busy.plan(0.0)
        busy.plan(0.0)
        for k in range(40):
            started(busy, f"r{k}", first_audio_at=0.0, generated=8)
        load = load_with(per_stream_s)
        assert (load > 0.75) if wait_s == 0.1 else load == pytest.approx(0.6)
        busy.submit(req("late", positions=40), now=0.5)
        if not wait_s:  # the defaults at a load of 60%: prefilled at once
            assert busy.plan(0.5).prefill_budget >= 40
            continue
        assert busy.plan(0.5).prefill_budget == 0  # waits for company
        assert busy.plan(0.5 + wait_s - 0.005).prefill_budget == 0
        assert busy.plan(0.5 + wait_s + 0.005).prefill_budget >= 40, (load, wait_s)


def test_while_requests_queue_for_their_start_new_prompts_wait_the_whole_time_for_company():
    """A light load (one stream playing) but requests waiting to start (held here by a step
    bound): the server is at capacity, so an admitted prompt waits the whole 100 ms for others
    to share its prefill, and its prefill held back keeps the queue's next request waiting too
    (a shorter wait at such loads let a closed loop past capacity in faster than its prefills
    and frame steps kept up: 74 of 407 streams gapped on the simulated clock)."""
    s = DeadlineScheduler(
        100,
        100,
        admission=Admission(AdmissionConfig(first_audio_budget_s=0, max_load=0, max_duty=0)),
        policy=DeadlinePolicy(coalesce_s=0.1, coalesce_rows=8),
    )
    s.submit(req("first", positions=50), now=0.0)
    s.plan(0.0)
    started(s, "first", first_audio_at=0.0, generated=8)
    s.admission.allows = lambda num_running, *args, **kwargs: num_running < 2  # room for one more
    s.submit(req("a", positions=40), now=0.5)
    s.submit(req("queued", positions=40), now=0.5)
    plan = s.plan(0.5)
    assert [r.request_id for r in plan.admitted] == ["a"] and s.num_waiting == 1
    assert plan.prefill_budget == 0  # light load, yet a waits for company: a request queues
    assert s.plan(0.595).prefill_budget == 0
    assert s.plan(0.605).prefill_budget >= 40


def test_admission_holds_while_too_many_streams_are_short_of_audio():
    """One listener of two running dry (50% > 20%) holds admission; one of five (20%) does not, so
    that a single slow reader cannot stop admission for everyone."""
    cfg = AdmissionConfig(max_duty=0, max_behind_fraction=0.2)
    s = DeadlineScheduler(max_batch=10, max_waiting=10, admission=Admission(cfg))
    for rid in "ab":
        s.submit(req(rid), now=0.0)
    s.plan(0.0)
    started(s, "a", first_audio_at=0.0, generated=30)
    started(s, "b", first_audio_at=0.0, generated=30).delivered_s = 0.5  # dry at 1.0 s
    s.submit(req("c"), now=1.0)
    assert s.plan(1.0).admitted == [] and "1 of 2 streams are short of audio" in s.holding_reason
    for rid in "xyz":
        s.running[rid] = req(rid)
        started(s, rid, first_audio_at=0.0, generated=30)
    assert [r.request_id for r in s.plan(1.0).admitted] == ["c"]


def steady_load(n: int, frames: int, positions: int, spread_s: float) -> list[tuple[float, int, int]]:
    return [(spread_s * i / n, frames, positions) for i in range(n)]


COST = Cost(base_s=0.004, per_stream_s=0.0002, prefill_position_s=0.00001, decode_s=0.005)


def round_robin() -> DeadlineScheduler:
    """The baseline: every stream steps every step, no pacing, no admission, whole prefills."""
    return DeadlineScheduler(
        10_000,
        10_000,
        policy=DeadlinePolicy(urgent_lead_s=math.inf, max_lead_s=math.inf, max_prefill_positions=10**9),
    )


def deadline() -> DeadlineScheduler:
    return DeadlineScheduler(10_000, 10_000, admission=Admission(AdmissionConfig(first_audio_budget_s=0)))


def test_deadline_scheduler_keeps_every_stream_on_time_where_round_robin_misses():
    """260 closed-loop streams of 10 s, each 300-position prompt replaced as it finishes: a
    round-robin step of all 260 takes 56 ms, while a newcomer's chunk ramp (4 | 4, 4, 8, 8, 16)
    needs its frames up to 1.43x faster than real time (one every 56 ms), before the prefill
    steps of the others. Paused streams leave the newcomers short steps."""
    load = steady_load(260, 125, 300, spread_s=2.0)
    rr = simulate(round_robin(), load, COST, closed_loop=260, until_s=40)
    dl = simulate(deadline(), load, COST, closed_loop=260, until_s=40)
    rr_done = [x for x in rr if x.finished_at is not None]
    dl_done = [x for x in dl if x.finished_at is not None]
    assert len(rr_done) >= 300 and len(dl_done) >= 300
    rr_gapped = sum(x.max_underrun_s() > 0 for x in rr_done)
    assert rr_gapped > len(rr_done) // 4  # the baseline misses for many streams
    assert all(x.max_underrun_s() == 0 for x in dl_done)
    assert not any(x.refused for x in dl)


def test_a_long_prefill_beside_running_streams_makes_none_of_them_late():
    """Running streams paced 300-500 ms ahead; a 60,000-position prompt (0.6 s of prefill) arrives.
    Budgeted per step from the tightest slack it is spread over steps: no running stream is late.
    The same prompt prefilled whole in one step makes them all late."""
    policy = DeadlinePolicy(urgent_lead_s=0.3, max_lead_s=0.5, max_prefill_positions=10**9)
    load = steady_load(20, 100, 100, spread_s=0.5) + [(3.0, 10, 60_000)]
    budgeted = DeadlineScheduler(
        100, 100, admission=Admission(AdmissionConfig(max_duty=0, safety_s=0.04)), policy=policy
    )
    whole = DeadlineScheduler(100, 100, policy=policy)
    for sched, late_expected in ((budgeted, False), (whole, True)):
        out = simulate(sched, load, COST, until_s=20, plan=ChunkPlan(1, (1,)))
        running = [x for x in out if x.prompt_positions == 100]
        assert all(x.finished_at is not None for x in running)
        late = [x for x in running if x.max_underrun_s() > 0]
        assert bool(late) is late_expected
        big = next(x for x in out if x.prompt_positions == 60_000)
        assert big.finished_at is not None and big.ttfa_s > 0.6


def poisson_load(rate: float, duration_s: float, frames: int, positions: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    while (t := t + rng.exponential(1.0 / rate)) < duration_s:
        out.append((t, frames, positions))
    return out


def test_config_flags_for_deadlines_and_admission():
    c = config_from_args([])
    assert (c.urgent_lead_ms, c.max_lead_ms) == (2000, 4000)
    assert (c.admission_max_duty, c.first_audio_budget_ms) == (0.6, 3000)
    with pytest.raises(SystemExit):
        config_from_args(["--urgent-lead-ms", "5000", "--max-lead-ms", "4000"])
    with pytest.raises(SystemExit):
        config_from_args(["--admission-max-duty", "-1"])


def test_the_coalescing_loads_are_flags_that_reach_the_scheduler():
    default = scheduler_for(config_from_args([])).policy
    assert (default.coalesce_from_load, default.coalesce_full_load) == (1.0, 1.25)
    c = config_from_args(["--prefill-coalesce-from-load", "0.3", "--prefill-coalesce-full-load", "0.6"])
    policy = scheduler_for(c).policy
    assert (policy.coalesce_from_load, policy.coalesce_full_load) == (0.3, 0.6)
    always = config_from_args(["--prefill-coalesce-full-load", "0"])
    assert scheduler_for(always).policy.coalesce_full_load == 0
    for bad in (("0.6", "0.3"), ("-0.1", "0.5"), ("0.5", "0.5")):
        with pytest.raises(SystemExit):
            config_from_args(["--prefill-coalesce-from-load", bad[0], "--prefill-coalesce-full-load", bad[1]])


def counting_steps(s: DeadlineScheduler) -> list[int]:
    """The width of every step `s` plans from now on."""
    steps: list[int] = []
    plan = s.plan

    def counted(now: float):
        p = plan(now)
        if p.step:
            steps.append(len(p.stepping))
        return p

    s.plan = counted
    return steps


def test_a_minimum_step_interval_makes_fewer_wider_steps_without_gaps():
    """300 closed-loop streams with prompts prefilled in batches (coalescing): streams that are
    due but not short step at most every 60 ms, so those falling under the lead bound in between
    join one step; first chunks and streams with under 150 ms left still step at once."""
    cost = Cost(
        base_s=0.005, per_stream_s=0.00002, prefill_position_s=0.00001, decode_s=0.01, prefill_step_s=0.03
    )
    counts = {}
    for interval in (0.0, 0.06):
        s = DeadlineScheduler(
            10_000,
            10_000,
            admission=Admission(AdmissionConfig(first_audio_budget_s=0, max_load=0)),
            policy=DeadlinePolicy(min_step_interval_s=interval, critical_s=0.15, coalesce_full_load=0),
        )
        steps = counting_steps(s)
        done = [
            x
            for x in simulate(s, steady_load(300, 125, 40, spread_s=10.0), cost, closed_loop=300, until_s=30)
            if x.finished_at is not None
        ]
        assert len(done) >= 590 and all(x.max_underrun_s() == 0 for x in done)
        counts[interval] = (len(steps), sum(steps) / len(steps))
    assert counts[0.06][0] < 0.6 * counts[0.0][0]  # fewer steps ...
    assert counts[0.06][1] > 1.5 * counts[0.0][1]  # ... each of more streams


def test_the_generation_loop_refuses_before_the_build_and_counts_it():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from qtts.serving.metrics import TalkerMetrics
    from services.talker.generation_loop import GenerationLoop

    metrics = TalkerMetrics(CollectorRegistry())
    generator = SimpleNamespace(num_active=0, step=lambda: [], cancel=lambda rid: None)
    loop = GenerationLoop(
        generator, DeadlineScheduler(max_batch=1, max_waiting=1), metrics, clock=lambda: 0.0
    )
    loop.check_admission(1)
    with pytest.raises(ResourceExhausted, match="at capacity"):
        loop.check_admission(2)
    assert metrics.registry.get_sample_value("tts_talker_refused_total") == 1


def _playing(s: DeadlineScheduler, rid: str, now: float, buffered_s: float) -> ScheduledRequest:
    """A running stream whose listener has `buffered_s` of audio at `now` (chunked frame by frame)."""
    r = s.running[rid]
    r.stepped = True
    r.first_audio_at = now - 1.0
    r.credit.generated = round((1.0 + buffered_s) / 0.08)
    r.delivered_s = r.credit.generated * 0.08
    return r


def test_a_first_chunk_rides_with_only_as_many_streams_as_its_step_budget_allows():
    """A new stream's first chunk steps at once; streams that are not urgent join its step up to
    `first_chunk_step_s` of predicted step time (the least ahead first), urgent ones always."""
    model = dict(step_base_s=0.004, step_per_stream_s=0.0001)
    widths = {}
    for budget in (0.04, 0.01):
        adm = Admission(AdmissionConfig(first_audio_budget_s=0, max_load=0, max_duty=0, **model))
        pol = DeadlinePolicy(first_chunk_step_s=budget, coalesce_s=0)
        s = DeadlineScheduler(1000, 10, admission=adm, policy=pol)
        now = 100.0
        for i in range(300):
            s.submit(req(f"p{i}"), now=0.0)
        while s.waiting:  # admission starts at most max_admit_per_step a plan
            s.plan(0.0)
        for i in range(300):
            # p0..p9 have 1.5 s buffered (urgent: under the 2 s lead), the rest 2.5-3.5 s.
            _playing(s, f"p{i}", now, 1.5 if i < 10 else 2.5 + i / 300)
        s.submit(req("new"), now=now)
        plan = s.plan(now)
        ids = {r.request_id for r in plan.stepping}
        assert plan.step and "new" in ids and {f"p{i}" for i in range(10)} <= ids
        widths[budget] = len(ids)
        riders = ids - {"new"} - {f"p{i}" for i in range(10)}
        # The riders are the least ahead of the optional streams.
        assert riders == {f"p{i}" for i in range(10, 10 + len(riders))}
    assert widths[0.04] == 301  # (40 - 4) ms / 0.1 ms = 360 rows allowed: all 301 streams ride
    assert widths[0.01] == int((0.01 - 0.004) / 0.0001)  # 60 rows: new, the 10 urgent, 49 riders


def test_under_a_backlog_streams_with_enough_audio_leave_the_steps_to_the_waiting_prompts():
    """With `backlog_lead_s`, a playing stream between it and the urgent lead steps only when a
    step runs anyway while requests wait; with nothing waiting it is urgent as before."""
    pol = DeadlinePolicy(backlog_lead_s=0.8, coalesce_s=0)
    s = DeadlineScheduler(8, 8, policy=pol)
    s.submit(req("a"), now=0.0)
    s.plan(0.0)
    now = 50.0
    _playing(s, "a", now, 1.5)  # under the 2 s urgent lead, over the 0.8 s backlog lead
    plan = s.plan(now)
    assert plan.step and [r.request_id for r in plan.stepping] == ["a"]  # no backlog: urgent
    # A request waiting for its prefill is a backlog: a is not urgent, but it rides the new
    # stream's step (the budget allows).
    s.submit(req("b"), now=now)
    plan = s.plan(now)
    assert {r.request_id for r in plan.stepping} == {"a", "b"}
    # Once b has stepped and plays, a request waiting to start (admission holds it: the batch is
    # full) keeps the backlog: nothing urgent, so no step, and the engine wakes when a's time
    # left falls to the backlog lead.
    _playing(s, "b", now, 3.0)
    full = DeadlineScheduler(2, 8, policy=pol)
    for rid in "ab":
        full.submit(req(rid), now=0.0)
    full.plan(0.0)
    _playing(full, "a", now, 1.5)
    _playing(full, "b", now, 3.0)
    full.submit(req("c"), now=now)
    plan = full.plan(now)
    assert not plan.step and len(full.waiting) == 1
    assert plan.wake_at == pytest.approx(now + full.running["a"].slack_s(now) - 0.8)
    _playing(full, "a", now, 0.7)  # under the backlog lead: urgent again
    assert full.plan(now).step


def test_narrow_first_chunk_steps_start_a_closed_loop_s_audio_sooner_without_gaps():
    """512 closed-loop 10 s streams on the simulated engine: with first chunks riding in steps of
    at most 15 ms, the median first audio comes sooner than with 40 ms steps, with no more gaps.
    (Half as soon before admission held while admitted prompts wait for their prefill; since, the
    burst is admitted as fast as it is prefilled, which sets much of its first audio either way;
    and prompts wait for company while requests queue, which makes the gain a sixth.)"""
    cost = Cost(
        base_s=0.0043, per_stream_s=0.00004, prefill_position_s=0.000025, decode_s=0.03, prefill_step_s=0.012
    )
    medians, gaps = {}, {}
    for budget in (0.04, 0.015):
        adm = Admission(
            AdmissionConfig(
                first_audio_budget_s=0,
                step_base_s=0.0043,
                step_per_stream_s=0.00004,
                prefill_position_s=0.000025,
            )
        )
        s = DeadlineScheduler(1024, 2048, admission=adm, policy=DeadlinePolicy(first_chunk_step_s=budget))
        out = simulate(s, [(i * 1e-6, 125, 220) for i in range(512)], cost, closed_loop=512, until_s=40)
        done = [x for x in out if x.finished_at is not None]
        assert len(done) == 1024
        gaps[budget] = sum(x.max_underrun_s() > 0 for x in done)
        medians[budget] = float(np.median([x.ttfa_s for x in done]))
    assert medians[0.015] < 0.85 * medians[0.04]
    # The burst's first stream has a few ms gap either way (its second chunk waits behind the
    # burst's prefills); the narrower steps add none.
    assert gaps[0.015] <= gaps[0.04] <= 2


def test_config_flags_for_the_backlog_lead_and_the_first_chunk_step():
    c = config_from_args([])
    assert (c.backlog_lead_ms, c.first_chunk_step_ms) == (0, 40)
    c = config_from_args(["--backlog-lead-ms", "800", "--first-chunk-step-ms", "15"])
    assert (c.backlog_lead_ms, c.first_chunk_step_ms) == (800, 15)
    for bad in (["--backlog-lead-ms", "100"], ["--backlog-lead-ms", "2500"], ["--first-chunk-step-ms", "0"]):
        with pytest.raises(SystemExit):
            config_from_args(bad)
    with pytest.raises(ValueError):
        DeadlinePolicy(backlog_lead_s=0.1)
