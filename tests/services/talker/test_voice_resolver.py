"""The voice resolver under a burst: one lookup and one computation per voice, however many
requests ask for it at once, and a caller that goes away cancels nothing the others wait on."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np

from services.talker.request import GenerationRequest
from services.talker.speaker_cache_client import SpeakerCacheClient
from services.talker.voices import VoiceResolver
from tests.services.talker.fakes import FakeBundle


class SlowBundle(FakeBundle):
    """compute_voice_prompt takes 50 ms and records which threads ran it, and how many at once."""

    def __init__(self):
        super().__init__()
        self.threads: set[str] = set()
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def compute_voice_prompt(self, pcm, ref_text, x_vector_only):
        with self._lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            self.threads.add(threading.current_thread().name)
        time.sleep(0.05)
        with self._lock:
            self.running -= 1
        return super().compute_voice_prompt(pcm, ref_text, x_vector_only)


def clip(voice: int) -> bytes:
    return np.full(2400, 0.01 * (voice + 1), dtype="<f4").tobytes()


def request(rid: str, voice: int) -> GenerationRequest:
    return GenerationRequest(rid, "hello", reference_pcm_f32=clip(voice), reference_text="ref words")


async def test_a_burst_for_a_few_new_voices_computes_each_voice_once_one_at_a_time():
    bundle = SlowBundle()
    resolver = VoiceResolver(bundle, SpeakerCacheClient(None), model_id="m")
    try:
        # 60 requests at once over 3 new voices (the first voice far the most asked for).
        voices = [0] * 40 + [1] * 15 + [2] * 5
        prompts = await asyncio.gather(*(resolver.resolve(request(f"r{i}", v)) for i, v in enumerate(voices)))
        assert bundle.compute_calls == 3 and resolver.computed == 3
        assert bundle.most_at_once == 1 and len(bundle.threads) == 1
        assert all(p is prompts[0] for p in prompts[:40])  # the one prompt of voice 0, shared
        assert prompts[40] is not prompts[0] and prompts[55] is not prompts[40]
        # Known now: no more computations, whatever arrives.
        await asyncio.gather(*(resolver.resolve(request(f"again{v}", v)) for v in range(3)))
        assert bundle.compute_calls == 3
    finally:
        await resolver.close()


async def test_a_caller_that_goes_away_does_not_cancel_the_lookup_others_wait_on():
    bundle = SlowBundle()
    resolver = VoiceResolver(bundle, SpeakerCacheClient(None), model_id="m")
    try:
        first = asyncio.create_task(resolver.resolve(request("first", 7)))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(resolver.resolve(request("second", 7)))
        await asyncio.sleep(0.01)
        first.cancel()
        prompt = await second
        assert first.cancelled() and prompt.ref_text == "ref words"
        assert bundle.compute_calls == 1
        assert await resolver.resolve(request("third", 7)) is prompt  # remembered
    finally:
        await resolver.close()


async def test_a_bad_clip_fails_every_request_that_waited_on_it_with_the_same_error():
    class Refusing(SlowBundle):
        def compute_voice_prompt(self, pcm, ref_text, x_vector_only):
            super().compute_voice_prompt(pcm, ref_text, x_vector_only)
            raise ValueError("the clip is too short")

    resolver = VoiceResolver(Refusing(), SpeakerCacheClient(None), model_id="m")
    try:
        results = await asyncio.gather(
            *(resolver.resolve(request(f"r{i}", 3)) for i in range(4)), return_exceptions=True
        )
        assert all("cannot compute the voice prompt: the clip is too short" in str(r) for r in results)
        assert resolver._inflight == {}  # nothing left behind: the next request tries again
    finally:
        await resolver.close()


async def test_each_computation_is_timed_as_its_own_stage():
    from prometheus_client import CollectorRegistry

    from qtts.serving.metrics import TalkerMetrics

    registry = CollectorRegistry()
    resolver = VoiceResolver(
        SlowBundle(), SpeakerCacheClient(None), model_id="m", metrics=TalkerMetrics(registry)
    )
    try:
        await asyncio.gather(*(resolver.resolve(request(f"r{i}", i % 2)) for i in range(6)))
    finally:
        await resolver.close()
    labels = {"service": "talker", "stage": "compute_voice_prompt"}
    assert registry.get_sample_value("tts_stage_latency_seconds_count", labels) == 2
    assert registry.get_sample_value("tts_stage_latency_seconds_sum", labels) >= 0.1  # 2 x 50 ms
