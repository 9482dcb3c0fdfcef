"""The in-process prompt queue builds the prompts queued while its thread is busy together
(`PromptBuilder.build_many`, at most `MAX_BUILD_BATCH` a call): each caller still gets the prompt
it would get alone, or its own error."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from qtts.model import SynthesisSpec, VoicePrompt
from qtts.request.errors import InvalidArgument, ResourceExhausted
from qtts.serving.metrics import TalkerMetrics
from services.talker.prompt_queue import MAX_BUILD_BATCH, PromptQueue, reference_rows


class CountingBuilder:
    """A prompt builder that counts its `build_many` calls and their sizes."""

    def __init__(self, builder):
        self.builder = builder
        self.sizes: list[int] = []

    def build_many(self, specs):
        self.sizes.append(len(specs))
        return self.builder.build_many(specs)


def _queue(builder, budget_s: float = 0.0) -> PromptQueue:
    bundle = SimpleNamespace(prompt_builder=builder, device=None)
    return PromptQueue(bundle, TalkerMetrics(CollectorRegistry()), budget_s)


def _voice(hidden: int, ref_frames: int | None, seed: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    codes = None if ref_frames is None else torch.randint(0, 2048, (ref_frames, 16), generator=g)
    return VoicePrompt(
        x_vector=torch.randn(hidden, generator=g),
        ref_codes=codes,
        ref_text=None if codes is None else "Hello world.",
        x_vector_only=codes is None,
    )


def _specs(bundle) -> list[SynthesisSpec]:
    hidden = bundle.talker.hidden_size
    icl, xvec = _voice(hidden, 12, seed=1), _voice(hidden, None, seed=2)
    return [
        SynthesisSpec(text="Hello there, number one.", task="voice_clone", voice_prompt=icl),
        SynthesisSpec(
            text="A second text, longer than the first one.", task="voice_clone", voice_prompt=xvec
        ),
        SynthesisSpec(text="Third.", task="voice_clone", voice_prompt=icl, streaming_text=False),
        SynthesisSpec(text="And a fourth.", task="voice_clone", language="german", voice_prompt=xvec),
    ]


def _equal(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and torch.equal(x, y), f.name
        elif f.name != "text_feed":
            assert x == y, f.name


async def _build_together(queue: PromptQueue, specs, queued_at=None) -> list:
    """Build `specs` queued while the prompt thread is busy; each result or error, in order."""
    busy, release = threading.Event(), threading.Event()
    held = asyncio.ensure_future(queue.run(lambda: (busy.set(), release.wait(5))))
    await asyncio.to_thread(busy.wait, 5)
    now = time.perf_counter()
    tasks = [
        asyncio.ensure_future(queue.build(spec, now if queued_at is None else queued_at[i]))
        for i, spec in enumerate(specs)
    ]
    await asyncio.sleep(0)  # every build queued behind the busy thread
    release.set()
    await held
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_prompts_queued_together_are_built_together_each_as_alone(tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    builder = CountingBuilder(bundle.prompt_builder)
    queue = _queue(builder)
    specs = _specs(bundle)
    results = await _build_together(queue, specs)
    assert builder.sizes == [len(specs)]
    assert results[0][1] is not None and results[1][1] is None  # ICL frames; none for an x-vector
    for spec, (prompt, rows) in zip(specs, results, strict=True):
        alone = bundle.prompt_builder.build(spec)
        _equal(prompt, alone)
        expected = reference_rows(alone)
        assert (rows is None) == (expected is None)
        if expected is not None:
            assert rows.dtype == expected.dtype and (rows == expected).all()
    assert queue.build_s > 0
    assert queue._metrics.registry.get_sample_value(
        "tts_stage_latency_seconds_count", {"service": "talker", "stage": "build_prompt"}
    ) == len(specs)


async def test_at_most_max_build_batch_prompts_a_call(tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    builder = CountingBuilder(bundle.prompt_builder)
    specs = (_specs(bundle) * MAX_BUILD_BATCH)[: MAX_BUILD_BATCH + 2]
    results = await _build_together(_queue(builder), specs)
    assert builder.sizes == [MAX_BUILD_BATCH, 2]
    assert not [r for r in results if isinstance(r, BaseException)]


async def test_a_bad_spec_fails_only_its_own_request(tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    builder = CountingBuilder(bundle.prompt_builder)
    specs = _specs(bundle)
    specs[1] = dataclasses.replace(specs[1], language="klingon")
    specs[2] = dataclasses.replace(specs[2], task="custom_voice")
    results = await _build_together(_queue(builder), specs)
    assert builder.sizes == [len(specs)]
    assert isinstance(results[1], InvalidArgument) and isinstance(results[2], InvalidArgument)
    for i in (0, 3):
        _equal(results[i][0], bundle.prompt_builder.build(specs[i]))


async def test_a_request_that_waited_past_the_budget_is_refused_and_the_rest_are_built(tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    builder = CountingBuilder(bundle.prompt_builder)
    queue = _queue(builder, budget_s=5.0)
    specs = _specs(bundle)
    now = time.perf_counter()
    results = await _build_together(queue, specs, queued_at=[now, now - 10.0, now, now])
    assert isinstance(results[1], ResourceExhausted)
    assert "first-audio budget" in str(results[1])
    assert builder.sizes == [len(specs) - 1]  # the refused one is not built
    for i in (0, 2, 3):
        _equal(results[i][0], bundle.prompt_builder.build(specs[i]))
    stage = queue._metrics.registry.get_sample_value
    assert stage("tts_stage_latency_seconds_count", {"service": "talker", "stage": "prompt_queue"}) == 4
    assert stage("tts_stage_latency_seconds_count", {"service": "talker", "stage": "build_prompt"}) == 3


class _Builder:
    """Prompts of plain strings; "bad" is refused with a ValueError, "boom" fails the batch."""

    def __init__(self):
        self.batches: list[list[str]] = []

    def build_many(self, specs):
        self.batches.append(list(specs))
        if "boom" in specs:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [ValueError("a bad text") if s == "bad" else SimpleNamespace(text=s) for s in specs]


async def test_a_value_error_is_the_callers_invalid_argument_and_a_device_error_fails_the_batch():
    builder = _Builder()
    queue = _queue(builder)
    ok, bad = await _build_together(queue, ["a", "bad"])
    assert ok[0].text == "a" and ok[1] is None
    assert isinstance(bad, InvalidArgument) and str(bad) == "a bad text"
    assert isinstance(bad.__cause__, ValueError)
    failed = await _build_together(queue, ["b", "boom"])
    assert all(isinstance(r, RuntimeError) for r in failed)


async def test_a_request_gone_before_the_thread_takes_it_is_not_built():
    builder = _Builder()
    queue = _queue(builder)
    busy, release = threading.Event(), threading.Event()
    held = asyncio.ensure_future(queue.run(lambda: (busy.set(), release.wait(5))))
    await asyncio.to_thread(busy.wait, 5)
    now = time.perf_counter()
    gone = asyncio.ensure_future(queue.build("gone", now))
    kept = asyncio.ensure_future(queue.build("kept", now))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)  # the cancel reaches its answer (a loop callback), as a caller's would
    release.set()
    await held
    assert (await kept)[0].text == "kept"
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert builder.batches == [["kept"]]
