"""The generation loop: batch bounds, and credit skips only the stream without credit."""

from __future__ import annotations

import queue
import time

import pytest
from prometheus_client import CollectorRegistry

from qtts.request.errors import ResourceExhausted
from qtts.serving.metrics import TalkerMetrics
from qtts.streams.chunk_plan import BURST_PLAN, ChunkPlan, StartPlanner
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler, ScheduledRequest, StreamCredit
from services.talker.generation_loop import Admitted, Failed, Finished, Frame, GenerationLoop
from tests.services.talker.fakes import FakeGenerator, FakePrompt


def make_req(rid: str, frames: int = 5, window: int = 2, granted: int = 0, sink=None) -> ScheduledRequest:
    credit = StreamCredit(window=window, granted_until=granted)
    return ScheduledRequest(rid, FakePrompt(frames), None, None, credit, sink or (lambda ev: None))


def test_credit_rules():
    c = StreamCredit(window=2)
    assert c.has_credit()
    c.generated = 2
    assert not c.has_credit()
    assert c.grant(3) and c.has_credit()
    assert not c.grant(1) and c.granted_until == 3  # grants never move backwards


def collect(events: queue.Queue, rid: str, kind: type, n: int, timeout: float = 10.0) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        ev_rid, ev = events.get(timeout=max(0.01, deadline - time.monotonic()))
        if ev_rid == rid and isinstance(ev, kind):
            got.append(ev)
    return got


def test_stream_without_credit_is_skipped_and_does_not_advance_while_others_continue():
    gen = FakeGenerator()
    metrics = TalkerMetrics(CollectorRegistry())
    engine = GenerationLoop(gen, DeadlineScheduler(max_batch=4, max_waiting=4), metrics, idle_wait_s=0.05)
    events: queue.Queue = queue.Queue()
    stalled = make_req("stalled", frames=100, window=2, sink=lambda ev: events.put(("stalled", ev)))
    free = make_req("free", frames=10, window=100, sink=lambda ev: events.put(("free", ev)))
    engine.start()
    try:
        engine.submit(stalled)
        engine.submit(free)
        frames = collect(events, "free", Frame, 10)
        collect(events, "free", Finished, 1)
        assert [f.index for f in frames] == list(range(10))
        # "stalled" made exactly its window of frames and was skipped on every later step.
        assert stalled.credit.generated == 2
        assert gen._active["stalled"][1] == 2
        assert any("stalled" in s for s in gen.skips)
        assert metrics.credit_stalls_total._value.get() >= 1
        # Credit lets it go on, by exactly the granted amount.
        engine.grant(stalled, 3)
        more = collect(events, "stalled", Frame, 3)
        assert [f.index for f in more] == [2, 3, 4]  # up to granted 3 + window 2
        time.sleep(0.05)
        assert stalled.credit.generated == 5 and gen._active["stalled"][1] == 5
    finally:
        engine.cancel("stalled")
        engine.stop()
    assert gen.num_active == 0


def test_engine_bounds_batch_and_cancel_frees_the_generator_slot():
    gen = FakeGenerator(max_batch=1)
    metrics = TalkerMetrics(CollectorRegistry())
    engine = GenerationLoop(gen, DeadlineScheduler(max_batch=1, max_waiting=1), metrics, idle_wait_s=0.05)
    events: queue.Queue = queue.Queue()
    a = make_req("a", frames=10_000, window=1, sink=lambda ev: events.put(("a", ev)))
    b = make_req("b", frames=3, window=10, sink=lambda ev: events.put(("b", ev)))
    engine.start()
    try:
        engine.submit(a)
        engine.submit(b)
        with pytest.raises(ResourceExhausted):
            engine.submit(make_req("c"))
        collect(events, "a", Admitted, 1)
        assert engine.counts() == (1, 1)  # b waits: the batch is full
        engine.cancel("a")
        collect(events, "b", Finished, 1)
        assert gen.max_seen_active == 1
        deadline = time.monotonic() + 5
        while gen.num_active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gen.num_active == 0 and engine.counts() == (0, 0)
        assert metrics.active_streams._value.get() == 0
    finally:
        engine.stop()


class NoSkipGenerator(FakeGenerator):
    """A generator whose step() takes no skip set (it steps everything in `active`)."""

    @property
    def active(self) -> dict:
        return self._active

    def step(self) -> list:
        return super().step(skip=())


def test_engine_skips_streams_on_a_generator_without_a_skip_parameter():
    gen = NoSkipGenerator()
    metrics = TalkerMetrics(CollectorRegistry())
    engine = GenerationLoop(gen, DeadlineScheduler(max_batch=4, max_waiting=0), metrics, idle_wait_s=0.05)
    events: queue.Queue = queue.Queue()
    held = make_req("held", frames=50, window=1, sink=lambda ev: events.put(("held", ev)))
    free = make_req("free", frames=6, window=100, sink=lambda ev: events.put(("free", ev)))
    engine.start()
    try:
        engine.submit(held)
        engine.submit(free)
        collect(events, "free", Finished, 1)
        assert gen._active["held"][1] == 1 and held.credit.generated == 1
        engine.grant(held, 2)
        collect(events, "held", Frame, 2)
        time.sleep(0.05)
        assert gen._active["held"][1] == 3
    finally:
        engine.cancel("held")
        engine.stop()
    assert gen.num_active == 0


class BrokenGenerator(FakeGenerator):
    def step(self, skip=()):
        raise RuntimeError("device lost")


def test_a_failing_step_fails_the_streams_in_it_and_frees_them():
    gen = BrokenGenerator()
    metrics = TalkerMetrics(CollectorRegistry())
    engine = GenerationLoop(gen, DeadlineScheduler(max_batch=4, max_waiting=0), metrics, idle_wait_s=0.05)
    events: queue.Queue = queue.Queue()
    engine.start()
    try:
        engine.submit(make_req("a", sink=lambda ev: events.put(("a", ev))))
        (failed,) = collect(events, "a", Failed, 1)
        assert "device lost" in failed.error.message
        assert engine.counts() == (0, 0) and gen.num_active == 0
    finally:
        engine.stop()


def test_a_request_the_generator_refuses_fails_with_its_own_error():
    """A generator that refuses a request as the caller's fault (InvalidArgument: e.g. longer than a
    KV slot) fails it with that error, not as an internal one; other failures stay internal."""
    from qtts.request.errors import GenerationFailed, InvalidArgument

    class Refusing(FakeGenerator):
        def add(self, request_id, prompt, sampling, max_new_frames=None):
            if request_id == "too-long":
                raise InvalidArgument("the prompt takes 2000 positions, this talker holds 1024")
            if request_id == "broken":
                raise RuntimeError("CUDA error")
            super().add(request_id, prompt, sampling, max_new_frames)

    engine = GenerationLoop(
        Refusing(),
        DeadlineScheduler(max_batch=4, max_waiting=4),
        TalkerMetrics(CollectorRegistry()),
        idle_wait_s=0.05,
    )
    queues = {rid: queue.Queue() for rid in ("too-long", "broken", "fine")}
    engine.start()
    try:
        for rid, q in queues.items():
            engine.submit(make_req(rid, frames=2, window=10, granted=10, sink=q.put))

        def last(rid: str):
            while True:
                ev = queues[rid].get(timeout=10)
                if isinstance(ev, Failed | Finished):
                    return ev

        too_long, broken, fine = last("too-long"), last("broken"), last("fine")
    finally:
        engine.stop()
    assert isinstance(too_long, Failed) and isinstance(too_long.error, InvalidArgument)
    assert "2000 positions" in too_long.error.message
    assert isinstance(broken, Failed) and isinstance(broken.error, GenerationFailed)
    assert "CUDA error" in broken.error.message
    assert isinstance(fine, Finished)


def test_the_scheduler_starts_no_more_streams_than_the_generator_has_slots():
    from types import SimpleNamespace

    from services.talker.config import TalkerConfig
    from services.talker.model_setup import scheduler_for

    metrics = TalkerMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="starts up to 4 streams, the generator holds 2"):
        GenerationLoop(FakeGenerator(max_batch=2), DeadlineScheduler(max_batch=4, max_waiting=4), metrics)
    # Fewer KV slots than --max-batch (GPU memory): the scheduler starts at most as many.
    config = TalkerConfig(max_batch=64)
    assert scheduler_for(config, SimpleNamespace(max_batch=40)).max_batch == 40
    assert scheduler_for(config, SimpleNamespace(max_batch=128)).max_batch == 64
    assert scheduler_for(config).max_batch == 64


def test_more_requests_than_graph_engine_slots_wait_in_the_deadline_scheduler(tiny_talker_bundle):
    """The GraphEngine has no queue (`add` with every slot taken raises NoFreeSlot): under the
    generation loop, requests beyond its slots wait in the deadline scheduler and all finish."""
    from qtts.engine import GraphEngine, GraphEngineConfig, RunnerConfig
    from qtts.model import SamplingParams
    from tests.qtts.engine.tiny_talker import make_prompt

    bundle = tiny_talker_bundle("base")
    runner = RunnerConfig(max_batch=2, max_len=96, max_trailing=16)
    eng = GraphEngine(bundle, config=GraphEngineConfig(runner=runner))
    added: list[int] = []  # requests in the engine after each add
    add = eng.add

    def counting_add(*args, **kwargs):
        add(*args, **kwargs)
        added.append(eng.num_active)

    eng.add = counting_add
    metrics = TalkerMetrics(CollectorRegistry())
    loop = GenerationLoop(
        eng, DeadlineScheduler(max_batch=eng.max_batch, max_waiting=8), metrics, idle_wait_s=0.05
    )
    events: queue.Queue = queue.Queue()
    sampling = SamplingParams(greedy=True, min_new_tokens=100)  # never stops by itself: runs to its bound
    names = [f"r{i}" for i in range(5)]
    loop.start()
    try:
        for i, rid in enumerate(names):
            credit = StreamCredit(window=1000, granted_until=1000)
            prompt = make_prompt(bundle, 10 + i, 2, seed=i)
            req = ScheduledRequest(
                rid, prompt, sampling, 3 + i, credit, lambda ev, rid=rid: events.put((rid, ev))
            )
            loop.submit(req)
        ends = {}
        deadline = time.monotonic() + 60
        while len(ends) < len(names):
            rid, ev = events.get(timeout=max(0.01, deadline - time.monotonic()))
            assert not isinstance(ev, Failed), (rid, ev)
            if isinstance(ev, Finished):
                ends[rid] = ev
    finally:
        loop.stop()
    assert {rid: (e.reason, e.num_frames) for rid, e in ends.items()} == {
        rid: ("length", 3 + i) for i, rid in enumerate(names)
    }
    assert len(added) == 5 and max(added) == 2 and eng.num_active == 0


def test_prefix_cache_hits_and_misses_reach_the_metrics():
    """The engine's GPU prefix cache counts (runner.prefix_cache.hits / misses) become
    tts_talker_prefix_cache_lookups_total{result} after each step that admitted prompts."""
    import torch

    from qtts.engine.prefix_cache import PrefixCache

    class CachedGenerator(FakeGenerator):
        def __init__(self):
            super().__init__()
            self.runner = type("Runner", (), {"prefix_cache": PrefixCache(1 << 20)})()

        def step(self, *args, **kwargs):
            cache = self.runner.prefix_cache
            for rid in list(self._active):  # a new prompt looks its prefix up once: first miss, then hits
                if rid not in self._looked_up:
                    self._looked_up.add(rid)
                    if cache.lookup("voice") == 0:
                        cache.put("voice", torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1))
            return super().step(*args, **kwargs)

    class PromptWithEmbeds(FakePrompt):
        embeds = torch.zeros(7, 1)  # 7 positions to prefill

    gen = CachedGenerator()
    gen._looked_up = set()
    registry = CollectorRegistry()
    engine = GenerationLoop(gen, DeadlineScheduler(max_batch=4, max_waiting=4), TalkerMetrics(registry), 0.05)
    events: queue.Queue = queue.Queue()
    engine.start()
    try:
        for rid in ("a", "b", "c"):
            credit = StreamCredit(window=100)
            req = ScheduledRequest(
                rid, PromptWithEmbeds(3), None, None, credit, lambda ev, rid=rid: events.put((rid, ev))
            )
            engine.submit(req)
            collect(events, rid, Finished, 1)
    finally:
        engine.stop()
    sample = registry.get_sample_value
    assert sample("tts_talker_prefix_cache_lookups_total", {"result": "miss"}) == 1
    assert sample("tts_talker_prefix_cache_lookups_total", {"result": "hit"}) == 2


class StepCounting(FakeGenerator):
    """Counts its steps and the step in which each request made its first frame (its prefill)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.prefilled_in: dict[str, int] = {}

    def step(self, skip=()) -> list:
        fresh = [rid for rid, st in self._active.items() if st[1] == 0 and rid not in set(skip)]
        outs = super().step(skip)
        for rid in fresh:
            self.prefilled_in[rid] = len(self.skips)
        return outs


@pytest.mark.parametrize("plan", [ChunkPlan(), BURST_PLAN], ids=["one-frame", "four-frame"])
def test_a_burst_gets_its_first_chunks_in_the_steps_right_after_its_prefill(plan):
    """Eight requests arrive together: all are prefilled in the first step, and each one's first
    chunk leaves the engine in the step that completes it: the prefill step itself for a one-frame
    first chunk, the next steps in a row for a four-frame one (no step skips a starting stream)."""
    gen = StepCounting()
    engine = GenerationLoop(
        gen, DeadlineScheduler(max_batch=16, max_waiting=16), TalkerMetrics(CollectorRegistry())
    )
    first_chunk_at: dict[str, tuple[int, Frame]] = {}

    def sink_for(rid: str):
        def sink(ev) -> None:
            if isinstance(ev, Frame) and rid not in first_chunk_at:
                first_chunk_at[rid] = (len(gen.skips), ev)

        return sink

    reqs = []
    for i in range(8):
        req = make_req(f"r{i}", frames=40, window=100, granted=100, sink=sink_for(f"r{i}"))
        req.chunk_plan = plan
        reqs.append(req)
        engine.submit(req)
    engine.start()
    try:
        deadline = time.monotonic() + 10
        while len(first_chunk_at) < len(reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for req in reqs:
            engine.cancel(req.request_id)
        engine.stop()
    assert set(gen.prefilled_in.values()) == {1}
    for req in reqs:
        step, frame = first_chunk_at[req.request_id]
        assert (frame.index, len(frame.codes)) == (0, plan.first)
        assert step == gen.prefilled_in[req.request_id] + plan.first - 1


def test_each_step_observes_the_admission_capacity_and_the_costs_it_comes_from():
    from services.talker.admission import Admission, AdmissionConfig

    config = AdmissionConfig(
        max_duty=0,
        step_base_s=0.004,
        step_per_stream_s=0.001,
        decoder_shares_gpu=True,
        decoder_frame_s=0.0005,
    )
    adm = Admission(config)
    metrics = TalkerMetrics(CollectorRegistry())
    engine = GenerationLoop(gen := FakeGenerator(), DeadlineScheduler(4, 4, admission=adm), metrics, 0.05)
    events: queue.Queue = queue.Queue()
    engine.start()
    try:
        engine.submit(make_req("a", frames=6, window=100, sink=lambda ev: events.put(("a", ev))))
        collect(events, "a", Finished, 1)
    finally:
        engine.stop()
    assert gen.num_active == 0
    registry = metrics.registry
    steps = registry.get_sample_value("tts_talker_admission_capacity_streams_count")
    assert steps is not None and steps >= 6  # one a step that ran
    # Tens of streams under these costs: every observation far above the one stream running.
    assert registry.get_sample_value("tts_talker_admission_capacity_streams_bucket", {"le": "32.0"}) == 0
    for cost, want in (("step_per_stream", adm.model.per_stream_s), ("decoder_frame", 0.0005)):
        assert registry.get_sample_value("tts_talker_admission_cost_seconds", {"cost": cost}) == want
    assert registry.get_sample_value("tts_talker_steps_over_capacity_total") == 0  # one stream, far under


def test_a_capacity_that_falls_under_the_running_streams_is_counted_a_step_at_a_time():
    from services.talker.admission import Admission, AdmissionConfig

    adm = Admission(
        AdmissionConfig(max_duty=0, step_base_s=0.004, step_per_stream_s=0.001, decoder_shares_gpu=True)
    )
    metrics = TalkerMetrics(CollectorRegistry())
    engine = GenerationLoop(FakeGenerator(), DeadlineScheduler(4, 4, admission=adm), metrics, 0.05)
    events: queue.Queue = queue.Queue()
    sink = {rid: (lambda ev, rid=rid: events.put((rid, ev))) for rid in ("a", "b")}
    engine.start()
    try:
        for rid in ("a", "b"):
            engine.submit(make_req(rid, frames=10_000, window=10_000, sink=sink[rid]))
        for rid in ("a", "b"):
            collect(events, rid, Admitted, 1)
        counter = "tts_talker_steps_over_capacity_total"
        assert metrics.registry.get_sample_value(counter) == 0
        # code2wav now publishes a decode cost that leaves room for one stream, with two running.
        adm.observe_decoder(0.1)
        assert adm.capacity(800.0) == 1
        deadline = time.monotonic() + 10
        while metrics.registry.get_sample_value(counter) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)  # the steps go on, both streams running, each one counted
        assert metrics.registry.get_sample_value(counter) >= 10
        assert engine.start_counts()[1] == 2
    finally:
        engine.cancel("a")
        engine.cancel("b")
        engine.stop()


def test_the_wait_from_admission_to_the_prefill_is_observed_once_a_request():
    """Three requests, each observed once, at the step that gave its first frame (its prefill's);
    the third is admitted while the others play and waits the whole 200 ms for company (the load
    scale off: coalesce_full_load 0), which its observation shows."""

    class BudgetGenerator(FakeGenerator):
        """Starts no new row in a step whose prefill budget is 0, as the engines do."""

        def __init__(self):
            super().__init__()
            self.started: set[str] = set()

        def step(self, skip=(), prefill_budget=None) -> list:
            if prefill_budget == 0:
                skip = set(skip) | (set(self._active) - self.started)
            outs = super().step(skip)
            self.started.update(o.request_id for o in outs)
            return outs

    gen = BudgetGenerator()
    metrics = TalkerMetrics(CollectorRegistry())
    policy = DeadlinePolicy(coalesce_s=0.2, coalesce_rows=8, coalesce_full_load=0)
    sched = DeadlineScheduler(max_batch=4, max_waiting=4, policy=policy)
    engine = GenerationLoop(gen, sched, metrics, idle_wait_s=0.05)
    events: queue.Queue = queue.Queue()
    # a and b last 80 s, at 5 ms a step: they play (paced 4 s ahead of their listeners) while c
    # comes and goes.
    reqs = {
        rid: make_req(rid, frames=frames, window=2000, sink=lambda ev, rid=rid: events.put((rid, ev)))
        for rid, frames in (("a", 1000), ("b", 1000), ("c", 40))
    }
    for rid in "ab":
        reqs[rid].prompt.step_delay_s = 0.005
    engine.start()
    try:
        engine.submit(reqs["a"])
        engine.submit(reqs["b"])
        collect(events, "a", Frame, 1)
        for rid in "ab":  # playing: their clocks run, so a newcomer waits for company
            reqs[rid].first_audio_at = time.perf_counter()
        engine.submit(reqs["c"])
        collect(events, "c", Finished, 1)
    finally:
        for rid in "ab":
            engine.cancel(rid)
        engine.stop()
    samples = metrics.prefill_wait_seconds.collect()[0].samples
    count = next(s.value for s in samples if s.name.endswith("_count"))
    assert count == 3
    assert metrics.prefill_wait_seconds._sum.get() >= 0.15  # c's wait for company


def test_start_counts_tell_a_backlog_from_a_request_between_two_plans():
    """`start_counts`' third figure (the new stream's chunk plan, `StartPlanner`): requests
    waiting to start that were submitted `StartPlanner.BACKLOG_AGE_S` or more ago. One submitted
    just now waits only for the scheduler's next plan, not behind a queue."""
    now = [100.0]
    sched = DeadlineScheduler(max_batch=1, max_waiting=8)
    engine = GenerationLoop(FakeGenerator(), sched, TalkerMetrics(CollectorRegistry()), clock=lambda: now[0])
    for rid, at in (("old", 99.0), ("recent", 100.0 - StartPlanner.BACKLOG_AGE_S), ("new", 99.99)):
        sched.submit(make_req(rid, frames=10, window=10), now=at)
    assert engine.start_counts() == (3, 3, 2)
    now[0] = 100.5
    assert engine.start_counts() == (3, 3, 3)
