"""The first-audio budget holds in the talker's prompt queue, the first queue a request waits in."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from qtts.request.errors import ResourceExhausted
from qtts.serving.metrics import TalkerMetrics
from services.talker.core import TalkerCore


def core(budget_s: float) -> TalkerCore:
    bundle = SimpleNamespace(info=SimpleNamespace(), device=None)
    return TalkerCore(
        bundle=bundle,
        engine=None,
        replicas=None,
        voices=None,
        metrics=TalkerMetrics(CollectorRegistry()),
        credit_window_frames=32,
        first_audio_budget_s=budget_s,
    )


def test_a_request_whose_prompt_could_not_start_within_the_budget_is_refused_at_once():
    c = core(3.0)
    c._build_s, c._prompts_waiting = 0.05, 50  # 2.5 s of prompts ahead: fits
    c._check_prompt_queue()
    c._prompts_waiting = 70  # 3.5 s
    with pytest.raises(ResourceExhausted, match="70 prompts wait") as err:
        c._check_prompt_queue()
    assert err.value.retry_after_s == 4


def test_a_prompt_that_waited_past_the_budget_is_not_built():
    c = core(1.0)
    built = []
    c._build_prompt = lambda *a: built.append(a)
    with pytest.raises(ResourceExhausted, match="waited .* for its prompt"):
        c._build_prompt_and_ref_codes(None, None, None, queued_at=time.perf_counter() - 2.0)
    assert built == []


def test_without_a_budget_nothing_is_refused():
    c = core(0.0)
    c._build_s, c._prompts_waiting = 1.0, 10_000
    c._check_prompt_queue()
