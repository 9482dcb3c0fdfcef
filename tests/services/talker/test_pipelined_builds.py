"""`--prompt-builds pipelined` in the engine process: each prompt is answered once the GPU has run
its kernels (its event on the prompt stream has passed), oldest first, while the next prompts are
built; the thread waits for the GPU only with nothing left to build. Fake events stand in for the
CUDA stream here; tests/services/talker/test_engine_process.py runs both modes through the real
engine process on the CPU."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from qtts.serving.metrics import TalkerMetrics
from services.talker.engine_prompts import MAX_BUILD_BATCH, PromptBuilds


class FakeEvent:
    """Passes when the test says the GPU got there (`passed`), or when waited for."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.passed = log, name, False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))
        self.passed = True


class FailingEvent(FakeEvent):
    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def worker(log: list, events: dict) -> PromptBuilds:
    stored: list = []

    def store(prompt):
        stored.append(prompt)
        return prompt

    w = PromptBuilds("pipelined", lambda call_id, ok, value: log.append(("reply", call_id, ok)), store)
    w.stored = stored
    w.metrics = TalkerMetrics(CollectorRegistry())
    w.stream = object()  # a stream is there: answers wait for events

    def build(spec):
        log.append(("build", spec))
        return SimpleNamespace(num_text_tokens=len(spec), ref_codes=None)

    w.on_stream = lambda fn, spec, wait=True: fn(spec)
    w.build = build
    w._record_event = lambda: events[log[-1][1]]
    return w


def queue(w: PromptBuilds, call_id: int, spec: str, queued_at: float | None = None) -> None:
    w.add(call_id, spec, time.perf_counter() if queued_at is None else queued_at, 5.0)


def test_each_prompt_is_answered_when_its_event_passes_while_the_next_are_built(monkeypatch):
    monkeypatch.setattr("services.talker.engine_prompts.spec_from_wire", lambda spec: spec)
    log: list = []
    events = {name: FakeEvent(log, name) for name in ("a", "bb", "ccc")}
    w = worker(log, events)
    for i, spec in enumerate(("a", "bb", "ccc")):
        queue(w, i, spec)
    events["a"].passed = True  # the GPU ran the first build's kernels before the second was built
    w.build_queued()
    kinds = [(kind, what) for kind, what, *_ in log]
    # All three built before any wait; "a" answered without one; then the oldest waited for.
    assert kinds == [
        ("build", "a"),
        ("reply", 0),
        ("build", "bb"),
        ("build", "ccc"),
        ("wait", "bb"),
        ("reply", 1),
        ("wait", "ccc"),
        ("reply", 2),
    ]
    replies = [entry for entry in log if entry[0] == "reply"]
    assert all(ok for _, _, ok in replies)
    assert w.queued == 0 and len(w.stored) == 3 and w.build_s > 0


def test_a_refused_build_fails_alone_and_a_device_error_fails_those_in_flight(monkeypatch):
    monkeypatch.setattr("services.talker.engine_prompts.spec_from_wire", lambda spec: spec)
    log: list = []
    events = {"a": FakeEvent(log, "a"), "late": FakeEvent(log, "late"), "c": FailingEvent(log, "c")}
    w = worker(log, events)
    queue(w, 0, "a")
    queue(w, 1, "late", queued_at=time.perf_counter() - 10.0)  # past the 5 s budget
    queue(w, 2, "c")
    events["a"].passed = True
    w.build_queued()
    replies = {entry[1]: entry[2] for entry in log if entry[0] == "reply"}
    assert replies == {0: True, 1: False, 2: False}
    assert ("build", "late") not in log  # refused before it was built
    assert len(w.stored) == 1  # only the one answered


def test_a_call_builds_at_most_a_batch_and_the_next_call_answers_what_is_in_flight(monkeypatch):
    monkeypatch.setattr("services.talker.engine_prompts.spec_from_wire", lambda spec: spec)
    log: list = []
    names = [f"p{i:02d}" for i in range(MAX_BUILD_BATCH + 2)]
    events = {name: FakeEvent(log, name) for name in names}
    w = worker(log, events)
    for i, name in enumerate(names):
        queue(w, i, name)
    w.build_queued()  # the cap: builds left, so no wait and nothing answered yet
    assert [e[1] for e in log if e[0] == "build"] == names[:MAX_BUILD_BATCH]
    assert not [e for e in log if e[0] in ("wait", "reply")] and len(w._inflight) == MAX_BUILD_BATCH
    w.build_queued()  # the next call builds the rest, then waits and answers every one in order
    assert [e[1] for e in log if e[0] == "build"] == names
    assert [e[1] for e in log if e[0] == "reply"] == list(range(len(names)))
    assert not w._inflight and not w._waiting
