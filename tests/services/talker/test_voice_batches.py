"""The voice prompt batcher: the clips that wait while a batch is computed go together as the
next, each clip gets its own result or error, and waits and computations are timed apart."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from qtts.model.voice_encoders import VoiceClip
from qtts.request.errors import InvalidArgument, Unavailable
from qtts.serving.metrics import TalkerMetrics
from services.talker.voice_batches import VoicePromptBatcher, one_by_one


def clip(i: int) -> VoiceClip:
    return VoiceClip(np.full(100, float(i), dtype=np.float32), f"text {i}", False)


class GatedComputer:
    """compute_many that holds its first call until released, recording every batch."""

    def __init__(self):
        self.batches: list[list[float]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, clips):
        self.batches.append([float(c.pcm[0]) for c in clips])
        self.entered.set()
        self.release.wait(10)
        return [InvalidArgument("bad clip") if c.pcm[0] == 3 else f"prompt {c.pcm[0]:g}" for c in clips]


async def test_clips_that_wait_during_a_batch_go_together_as_the_next():
    computer = GatedComputer()
    registry = CollectorRegistry()
    batcher = VoicePromptBatcher(computer, max_batch=4, metrics=TalkerMetrics(registry))
    try:
        first = asyncio.ensure_future(batcher.compute(clip(0)))
        await asyncio.to_thread(computer.entered.wait, 10)
        rest = [asyncio.ensure_future(batcher.compute(clip(i))) for i in range(1, 7)]
        await asyncio.sleep(0)
        computer.release.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
    finally:
        batcher.close()
    # One call for the first clip, then the six that waited: four (max_batch) and two.
    assert computer.batches == [[0.0], [1.0, 2.0, 3.0, 4.0], [5.0, 6.0]]
    assert results[3].message == "bad clip"  # its own error; the others their prompts
    assert [r for i, r in enumerate(results) if i != 3] == [f"prompt {i}" for i in (0, 1, 2, 4, 5, 6)]
    assert batcher.batches == 3 and batcher.largest_batch == 4
    for stage in ("voice_prompt_queue", "compute_voice_prompt"):
        labels = {"service": "talker", "stage": stage}
        assert registry.get_sample_value("tts_stage_latency_seconds_count", labels) == 7


async def test_a_failing_computer_fails_its_batch_and_the_next_batch_goes_on():
    calls = []

    def flaky(clips):
        calls.append(len(clips))
        if len(calls) == 1:
            raise RuntimeError("device went away")
        return [f"prompt {c.pcm[0]:g}" for c in clips]

    batcher = VoicePromptBatcher(flaky)
    try:
        with pytest.raises(Unavailable, match="could not be computed: RuntimeError"):
            await batcher.compute(clip(1))
        assert await batcher.compute(clip(2)) == "prompt 2"
    finally:
        batcher.close()


async def test_one_by_one_gives_each_clip_its_own_error():
    def compute_one(pcm, ref_text, x_vector_only):
        if pcm[0] == 1:
            raise ValueError("too short")
        return ref_text

    results = one_by_one(compute_one)([clip(0), clip(1), clip(2)])
    assert results[0] == "text 0" and isinstance(results[1], ValueError) and results[2] == "text 2"


async def test_a_closed_batcher_refuses_and_fails_what_waits():
    computer = GatedComputer()
    batcher = VoicePromptBatcher(computer)
    first = asyncio.ensure_future(batcher.compute(clip(0)))
    await asyncio.to_thread(computer.entered.wait, 10)
    waiting = asyncio.ensure_future(batcher.compute(clip(1)))
    await asyncio.sleep(0)
    batcher.close()
    computer.release.set()
    assert await first == "prompt 0"  # the batch in flight ends with its computer
    with pytest.raises(Unavailable, match="stopping"):
        await waiting
    with pytest.raises(Unavailable, match="stopping"):
        await batcher.compute(clip(2))
