"""Real-time admission guard: waiting requests are held while the running streams are at their pace
limit (slow steps, or streams whose delivered audio falls behind real time), never when nothing runs."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from qtts.metrics import TalkerMetrics
from services.talker.admission import GuardConfig, RealtimeGuard
from services.talker.config import config_from_args
from services.talker.engine import Finished, Frame, GenerationEngine
from services.talker.scheduler import ScheduledRequest, Scheduler, StreamCredit
from tests.services.talker.fakes import FakeGenerator, FakePrompt


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stream(first_audio_at=None, delivered_s=0.0):
    return SimpleNamespace(first_audio_at=first_audio_at, delivered_s=delivered_s)


def test_step_time_signal_is_an_average_against_the_budget():
    guard = RealtimeGuard(GuardConfig(step_budget_s=0.050, min_lead_s=0, ewma_alpha=0.5))
    running = [stream()]
    assert guard.allows(running)  # no step seen yet
    guard.observe_step(0.040)
    assert guard.allows(running) and guard.reason == ""
    guard.observe_step(0.080)  # average 0.060
    assert not guard.allows(running) and "over the 50 ms budget" in guard.reason
    assert guard.allows([])  # nothing running: nothing to protect
    guard.observe_step(0.020)  # average 0.040
    assert guard.allows(running)


def test_delivery_lead_signal_counts_mature_streams_behind_real_time():
    clock = Clock()
    guard = RealtimeGuard(
        GuardConfig(step_budget_s=0, min_lead_s=0.2, max_behind_fraction=0.25, warmup_s=1.0), clock=clock
    )
    # Started 5 s ago: 6 s delivered = 1 s ahead; 5.1 s delivered = 0.1 s ahead (behind the 0.2 s floor).
    ahead = [stream(clock.t - 5.0, 6.0) for _ in range(3)]
    behind = stream(clock.t - 5.0, 5.1)
    young = [stream(clock.t - 0.5, 0.0) for _ in range(10)]  # in warm-up: not judged
    waiting = stream()  # no audio yet
    assert guard.allows([*ahead, *young, waiting])
    assert not guard.allows([*ahead[:2], behind, *young])  # 1 of 3 mature > 25%
    assert "1 of 3 streams under 200 ms" in guard.reason
    assert guard.allows([*ahead, behind])  # 1 of 4 = 25%: not more than the fraction
    clock.t += 2.0  # two more seconds with nothing delivered: everyone falls behind
    assert not guard.allows(ahead)


def test_config_validation():
    for bad in (dict(step_budget_s=-1), dict(max_behind_fraction=1.0), dict(ewma_alpha=0), dict(max_admit_per_step=0)):
        with pytest.raises(ValueError):
            GuardConfig(**bad)
    assert config_from_args([]).admission_step_budget_ms == 64.0
    assert config_from_args(["--admission-min-lead-ms", "0"]).admission_min_lead_ms == 0.0
    with pytest.raises(SystemExit):
        config_from_args(["--admission-step-budget-ms", "-1"])


def make_req(rid, frames, sink, delay=0.0) -> ScheduledRequest:
    return ScheduledRequest(rid, FakePrompt(frames, step_delay_s=delay), None, None, StreamCredit(window=1000,
                            granted_until=1000), sink)


def test_scheduler_admits_only_while_the_guard_allows_and_a_few_per_step():
    guard = RealtimeGuard(GuardConfig(step_budget_s=0.010, min_lead_s=0, max_admit_per_step=2))
    s = Scheduler(max_batch=10, max_waiting=10, guard=guard)
    for i in range(10):
        s.submit(make_req(f"r{i}", 5, lambda ev: None))
    assert [r.request_id for r in s.admit()] == ["r0", "r1"]  # a burst ramps up: 2 per step
    assert [r.request_id for r in s.admit()] == ["r2", "r3"]
    assert [r.request_id for r in s.admit()] == ["r4", "r5"]
    assert [r.request_id for r in s.admit()] == ["r6", "r7"]
    assert [r.request_id for r in s.admit()] == ["r8", "r9"]
    assert s.admit() == [] and s.num_running == 10  # max_batch
    s.remove("r0")
    s.submit(make_req("r10", 5, lambda ev: None))
    guard.observe_step(0.5)
    assert not s.can_admit() and s.admit() == []  # a free slot, but slow steps: r10 waits
    for rid in list(s.running):
        s.remove(rid)
    assert [r.request_id for r in s.admit()] == ["r10"]  # everything finished: admitted again


@pytest.mark.parametrize("guarded", [True, False])
def test_slow_steps_hold_the_next_request_until_the_running_one_finishes(guarded):
    """Steps of 20 ms against a 5 ms budget: the second request waits in the queue (its audio starts
    late) instead of sharing the steps. Without the guard it starts at once: the test can fail."""
    gen = FakeGenerator()
    metrics = TalkerMetrics(CollectorRegistry())
    guard = RealtimeGuard(GuardConfig(step_budget_s=0.005, min_lead_s=0)) if guarded else None
    engine = GenerationEngine(gen, Scheduler(max_batch=4, max_waiting=4, guard=guard), metrics, idle_wait_s=0.05)
    events: queue.Queue = queue.Queue()
    a = make_req("a", 15, lambda ev: events.put(("a", ev)), delay=0.02)
    b = make_req("b", 3, lambda ev: events.put(("b", ev)))
    engine.start()
    order = []
    try:
        engine.submit(a)
        while True:  # a's first frame: its steps have been timed
            rid, ev = events.get(timeout=10)
            if rid == "a" and isinstance(ev, Frame):
                break
        engine.submit(b)
        done = set()
        while done != {"a", "b"}:
            rid, ev = events.get(timeout=10)
            if isinstance(ev, Frame | Finished):
                order.append((rid, type(ev).__name__))
            if isinstance(ev, Finished):
                done.add(rid)
    finally:
        engine.stop()
    a_end = order.index(("a", "Finished"))
    b_first = order.index(("b", "Frame"))
    if guarded:
        assert b_first > a_end
        assert metrics.admission_holds_total._value.get() >= 1
        assert metrics.admission_held._value.get() == 0  # nothing waits any more
    else:
        assert b_first < a_end
    assert gen.num_active == 0
