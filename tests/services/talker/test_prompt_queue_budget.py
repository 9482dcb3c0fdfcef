"""The first-audio budget holds in the talker's prompt queue, the first queue a request waits in."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from qtts.request.errors import ResourceExhausted
from qtts.request.vocabulary import Task
from qtts.serving.metrics import TalkerMetrics
from services.talker import core as core_module
from services.talker.core import TalkerCore
from services.talker.request import GenerationRequest


def core(budget_s: float, bundle=None, engine=None, voices=None) -> TalkerCore:
    return TalkerCore(
        bundle=bundle or SimpleNamespace(info=SimpleNamespace(), device=None),
        engine=engine,
        replicas=None,
        voices=voices,
        metrics=TalkerMetrics(CollectorRegistry()),
        credit_window_frames=32,
        first_audio_budget_s=budget_s,
    )


def waiting(c: TalkerCore, n: int, stack: contextlib.ExitStack) -> None:
    """`n` more requests waiting for their prompts (until `stack` closes)."""
    for _ in range(n):
        stack.enter_context(c.prompts.waiting_for(time.perf_counter()))


def test_a_request_whose_prompt_could_not_start_within_the_budget_is_refused_at_once():
    c = core(3.0)
    c.prompts.build_s = 0.05
    with contextlib.ExitStack() as stack:
        waiting(c, 50, stack)  # 2.5 s of prompts ahead: fits
        c.prompts.check()
        waiting(c, 20, stack)  # 3.5 s
        with pytest.raises(ResourceExhausted, match="70 prompts wait") as err:
            c.prompts.check()
        assert err.value.retry_after_s == 4
    assert c.prompts.waiting == 0


async def test_a_prompt_that_waited_past_the_budget_is_not_built():
    built = []
    bundle = SimpleNamespace(info=SimpleNamespace(), device=None, build_prompt=built.append)
    c = core(1.0, bundle)
    with pytest.raises(ResourceExhausted, match="waited .* for its prompt"):
        await c.prompts.build(object(), queued_at=time.perf_counter() - 2.0)
    assert built == []


def test_without_a_budget_nothing_is_refused():
    c = core(0.0)
    c.prompts.build_s = 1.0
    with contextlib.ExitStack() as stack:
        waiting(c, 10_000, stack)
        c.prompts.check()


class _CountingVoices:
    def __init__(self):
        self.resolved = 0

    async def resolve(self, req):
        self.resolved += 1
        return object()


class _RefusingEngine:
    def __init__(self, refuse: bool):
        self.refuse = refuse
        self.asked: list[int] = []

    def check_admission(self, ahead: int) -> None:
        self.asked.append(ahead)
        if self.refuse:
            raise ResourceExhausted("the talker is at capacity: no start within the budget", 2)


def _clone_core(monkeypatch, budget_s: float, engine, in_engine: bool) -> tuple[TalkerCore, _CountingVoices]:
    monkeypatch.setattr(
        core_module, "check_request", lambda req, info: SimpleNamespace(task=Task.VOICE_CLONE)
    )
    monkeypatch.setattr(core_module, "merge_sampling", lambda defaults, overrides: None)
    fields = {"info": SimpleNamespace(), "device": None, "generation_defaults": None}
    if in_engine:
        fields["build_prompt_async"] = lambda *a: None
    voices = _CountingVoices()
    return core(budget_s, SimpleNamespace(**fields), engine, voices), voices


async def _first(c: TalkerCore) -> None:
    req = GenerationRequest(request_id="r1", text="hello", reference_digest="d" * 64)
    async with contextlib.aclosing(c.generate(req)) as items:
        async for _ in items:
            break


@pytest.mark.parametrize("in_engine", [False, True])
async def test_a_full_prompt_queue_refuses_before_the_voice_is_resolved(monkeypatch, in_engine):
    c, voices = _clone_core(monkeypatch, 3.0, _RefusingEngine(refuse=False), in_engine)
    c.prompts.build_s = 0.05
    with contextlib.ExitStack() as stack:
        waiting(c, 70, stack)  # 3.5 s of prompts ahead, over the 3 s budget
        with pytest.raises(ResourceExhausted, match="70 prompts wait"):
            await _first(c)
    assert voices.resolved == 0


async def test_the_engines_admission_refuses_before_the_voice_is_resolved(monkeypatch):
    engine = _RefusingEngine(refuse=True)
    c, voices = _clone_core(monkeypatch, 3.0, engine, in_engine=False)
    with contextlib.ExitStack() as stack:
        waiting(c, 3, stack)
        with pytest.raises(ResourceExhausted, match="at capacity"):
            await _first(c)
    assert voices.resolved == 0 and engine.asked == [3]
