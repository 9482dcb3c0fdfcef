"""The voice worker process on the tiny real Base model (CPU): the prompts of the in-process
encoders, one bad clip failing alone, many distinct voices at once, a dead worker replaced, and
the worker ending with the talker."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import torch

from qtts.model.voice_encoders import VoiceClip
from qtts.pb import tts_pb2
from qtts.request.errors import InvalidArgument
from services.talker.request import GenerationRequest
from services.talker.speaker_cache_client import SpeakerCacheClient
from services.talker.voice_worker import VoiceWorker, VoiceWorkerSpec
from services.talker.voices import VoiceResolver
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.stack import generate_all, talker_stack


def pcm(seed: int, samples: int) -> np.ndarray:
    t = np.arange(samples) / 24000
    rng = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * (120 + 40 * seed) * t)
    return (tone + 0.02 * rng.standard_normal(samples)).astype(np.float32)


def spec(tiny_snapshot) -> VoiceWorkerSpec:
    # The threads of this process (tests/conftest.py): the host's reductions then round alike.
    return VoiceWorkerSpec(model_path=str(tiny_snapshot("base")), torch_threads=torch.get_num_threads())


def assert_same_prompt(got, want, exact_x_vector: bool = True) -> None:
    if exact_x_vector:
        assert torch.equal(got.x_vector, want.x_vector)
    else:  # a batch's kernels may round differently from one clip's
        torch.testing.assert_close(got.x_vector, want.x_vector, rtol=1e-5, atol=1e-5)
    assert (got.ref_codes is None) == (want.ref_codes is None)
    if want.ref_codes is not None:
        assert got.ref_codes.dtype == want.ref_codes.dtype and torch.equal(got.ref_codes, want.ref_codes)
    assert (got.ref_text, got.x_vector_only) == (want.ref_text, want.x_vector_only)


@pytest.fixture(scope="module")
def worker(tiny_snapshot):
    w = VoiceWorker(spec(tiny_snapshot))
    w.start()
    yield w
    w.stop()


def request(rid: str, clip: np.ndarray, ref_text: str = "reference words") -> GenerationRequest:
    return GenerationRequest(
        rid, "hello", reference_pcm_f32=clip.astype("<f4").tobytes(), reference_text=ref_text
    )


def test_the_worker_computes_the_prompts_of_the_in_process_encoders_exactly(worker, tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    assert worker.pid != os.getpid()
    assert worker.fingerprint == bundle.voice_encoder_fingerprint()  # the very same weights
    clips = [
        VoiceClip(pcm(1, 24000), "a reference clip", False),
        VoiceClip(pcm(2, 50001), "another one", False),
        VoiceClip(pcm(3, 36000), None, True),
    ]
    for clip in clips:  # one at a time: one encoder call each, as in the process
        (got,) = worker.compute_many([clip])
        assert_same_prompt(got, bundle.compute_voice_prompt(clip.pcm, clip.ref_text, clip.x_vector_only))


def test_a_batch_gives_every_voice_its_own_prompt_and_a_bad_clip_its_own_error(worker, tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    same_length = [VoiceClip(pcm(s, 30000), f"words {s}", s == 12) for s in range(10, 14)]
    other = VoiceClip(pcm(20, 41000), "other words", False)
    too_short = VoiceClip(pcm(21, 300), "short", False)
    results = worker.compute_many([*same_length, too_short, other])
    assert isinstance(results[4], InvalidArgument) and "too short" in results[4].message
    assert_same_prompt(results[5], bundle.compute_voice_prompt(other.pcm, other.ref_text, False))
    for clip, got in zip(same_length, results[:4], strict=True):
        # Clips of one length go through each encoder together: each gets its own codes.
        want = bundle.compute_voice_prompt(clip.pcm, clip.ref_text, clip.x_vector_only)
        assert_same_prompt(got, want, exact_x_vector=False)


async def test_requests_for_many_distinct_voices_at_once_are_all_served(tiny_snapshot, tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    worker = VoiceWorker(spec(tiny_snapshot))
    await asyncio.to_thread(worker.start)
    resolver = VoiceResolver(bundle, SpeakerCacheClient(None), model_id="m", worker=worker)
    voices = {v: pcm(30 + v, 24000 + 1920 * (v % 3)) for v in range(12)}
    asks = [v for v in voices for _ in range(3)]  # every voice asked for three times at once
    try:
        results = await asyncio.gather(
            *(resolver.resolve(request(f"r{i}", voices[v])) for i, v in enumerate(asks)),
            resolver.resolve(request("bad", pcm(99, 200))),
            return_exceptions=True,
        )
        assert worker.alive()
    finally:
        await resolver.close()
    assert not worker.alive()  # stopped with the resolver
    assert isinstance(results[-1], InvalidArgument)  # the bad clip fails its own request only
    assert resolver.computed == 12
    for v, got in zip(asks, results[:-1], strict=True):
        want = bundle.compute_voice_prompt(voices[v], "reference words", False)
        assert_same_prompt(got, want, exact_x_vector=False)
    assert 1 <= resolver.batcher.batches <= 13


def test_a_dead_worker_is_replaced_for_the_next_voice(tiny_snapshot, tiny_talker_bundle):
    bundle = tiny_talker_bundle("base")
    w = VoiceWorker(spec(tiny_snapshot))
    try:
        w.start()
        first = w.pid
        os.kill(first, signal.SIGKILL)
        clip = VoiceClip(pcm(5, 26000), "words", False)
        (got,) = w.compute_many([clip])
        assert_same_prompt(got, bundle.compute_voice_prompt(clip.pcm, "words", False))
        assert w.starts == 2 and w.pid != first and w.alive()
    finally:
        w.stop()
    assert not w.alive()


async def test_the_talker_starts_and_stops_its_voice_worker(tiny_snapshot):
    c2w = FakeCode2Wav("c2w-a")
    clip = pcm(7, 30000)
    async with talker_stack([c2w], bundle=None, model=str(tiny_snapshot("base")), engine_process="on") as s:
        worker = s.talker._voice_worker
        assert worker is not None and worker.alive()
        assert worker.pid not in (os.getpid(), s.talker.engine_client.facts.pid)
        _, summary = await generate_all(
            s.stub,
            request_id="v",
            text="Hello world.",
            reference_pcm_f32=clip.astype("<f4").tobytes(),
            reference_text="a reference clip",
            max_new_frames=4,
            sampling=tts_pb2.SamplingParams(greedy=True),  # sampled codes may stop early
        )
        assert summary.num_frames == 4
        stage = {"service": "talker", "stage": "voice_prompt_queue"}
        assert s.talker.metrics.registry.get_sample_value("tts_stage_latency_seconds_count", stage) == 1
    assert not worker.alive()


def ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def test_a_front_that_dies_takes_its_worker_with_it(tiny_snapshot):
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from services.talker.voice_worker import VoiceWorker, VoiceWorkerSpec\n"
        "if __name__ == '__main__':\n"
        f"    w = VoiceWorker(VoiceWorkerSpec(model_path={str(tiny_snapshot('base'))!r}))\n"
        "    w.start()\n"
        "    print(w.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(front.stdout.readline())
        assert not ended(pid)
        front.kill()  # no stop, no cleanup: the worker sees its pipe close
        front.wait()
        deadline = time.monotonic() + 30
        while not ended(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ended(pid)
    finally:
        front.kill()
        front.wait()
