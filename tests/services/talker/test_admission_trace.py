"""The admission trace (`--admission-trace`): every plan, step and room of a real generation loop
as JSON lines, and a writer that never blocks the engine."""

from __future__ import annotations

import queue

import pytest
from prometheus_client import CollectorRegistry

from qtts.request.errors import ResourceExhausted
from qtts.serving.metrics import TalkerMetrics
from services.talker.admission import Admission, AdmissionConfig
from services.talker.admission_trace import PLAN_FIELDS, AdmissionTrace, read_trace
from services.talker.config import TalkerConfig
from services.talker.deadline import DeadlineScheduler
from services.talker.generation_loop import Admitted, Finished, GenerationLoop
from services.talker.model_setup import admission_trace_for
from tests.services.talker.fakes import FakeGenerator
from tests.services.talker.test_generation_loop import collect, make_req


def test_the_trace_records_each_plan_step_and_room_of_a_running_loop(tmp_path):
    path = tmp_path / "trace" / "admission.jsonl"  # its folder is made
    admission = Admission(AdmissionConfig(first_audio_budget_s=6.0))
    scheduler = DeadlineScheduler(max_batch=4, max_waiting=4, admission=admission)
    trace = AdmissionTrace(path, flush_s=0.01)
    engine = GenerationLoop(
        FakeGenerator(), scheduler, TalkerMetrics(CollectorRegistry()), idle_wait_s=0.05, trace=trace
    )
    events: queue.Queue = queue.Queue()
    ids = ("a", "b", "c")
    engine.start()
    try:
        for rid in ids:
            engine.submit(make_req(rid, frames=6, window=100, sink=lambda ev, rid=rid: events.put((rid, ev))))
        for rid in ids:
            collect(events, rid, Finished, 1)
        room = engine.headroom(ahead=2)
    finally:
        engine.stop()  # closes the trace: every line is written

    rows = read_trace(path)
    plans = [r for r in rows if r["kind"] == "plan"]
    steps = [r for r in rows if r["kind"] == "step"]
    rooms = [r for r in rows if r["kind"] == "room"]
    assert sum(p["admitted"] for p in plans) == 3
    assert all(set(PLAN_FIELDS) <= set(p) for p in plans)
    assert all(p["capacity"] is not None and p["step_base_s"] > 0 for p in plans)
    # Each stream's 6 frames came from steps; the first step of each prefilled its prompt.
    assert sum(s["prompts"] for s in steps) == 3
    assert sum(s["batch"] for s in steps) >= 3 * 6
    assert all(s["seconds"] >= 0 for s in steps)
    assert [p["t"] for p in plans] == sorted(p["t"] for p in plans)
    (last_room,) = rooms
    assert last_room["ahead"] == 2
    assert (last_room["accept"], last_room["start_now"]) == (room.accept, room.start_now)
    assert last_room["running"] == 0


def test_lines_past_the_pending_bound_are_dropped_and_counted(tmp_path):
    path = tmp_path / "t.jsonl"
    trace = AdmissionTrace(path, flush_s=60.0, max_pending=2)  # the writer thread does not run first
    for i in range(5):
        trace.step(float(i), batch=i, prompts=0, prefill_positions=0, seconds=float("inf"))
    trace.close()
    rows = read_trace(path)
    assert rows[0] == {"kind": "gap", "dropped": 3}
    assert [r["batch"] for r in rows[1:]] == [0, 1]
    assert rows[1]["seconds"] is None  # no infinity in JSON


def test_the_flag_opens_a_trace_and_its_absence_none(tmp_path):
    assert admission_trace_for(TalkerConfig()) is None
    trace = admission_trace_for(TalkerConfig(admission_trace=str(tmp_path / "a.jsonl")))
    try:
        assert trace is not None and trace.path == tmp_path / "a.jsonl"
    finally:
        trace.close()


def test_a_refusal_at_submission_is_traced_with_its_predicted_wait(tmp_path):
    path = tmp_path / "t.jsonl"
    scheduler = DeadlineScheduler(max_batch=1, max_waiting=0, admission=Admission(AdmissionConfig()))
    engine = GenerationLoop(
        FakeGenerator(), scheduler, TalkerMetrics(CollectorRegistry()), idle_wait_s=0.05,
        trace=AdmissionTrace(path, flush_s=0.01),
    )  # fmt: skip
    events: queue.Queue = queue.Queue()
    engine.start()
    try:
        engine.submit(make_req("long", frames=10_000, window=1, sink=lambda ev: events.put(("long", ev))))
        collect(events, "long", Admitted, 1)
        with pytest.raises(ResourceExhausted):
            engine.submit(make_req("next"))
        with pytest.raises(ResourceExhausted):
            engine.check_admission(3)
    finally:
        engine.stop()
    refusals = [r for r in read_trace(path) if r["kind"] == "refuse"]
    assert [(r["ahead"], r["running"], r["waiting"]) for r in refusals] == [(0, 1, 0), (3, 1, 0)]
    assert all("predicted_wait_s" in r for r in refusals)
