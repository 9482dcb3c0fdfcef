"""Voice prompts through a real in-process speaker_cache: computed once, shared by content key."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from qtts.pb import speaker_cache_pb2, tts_pb2
from qtts.request.vocabulary import UNKNOWN_VOICE
from qtts.streams.voice_key import (
    REFERENCE_NOT_CACHED,
    is_reference_digest,
    reference_digest,
    voice_prompt_key,
    voice_prompt_key_for_digest,
)
from services.launcher import free_port
from tests.services.talker.fakes import FakeBundle, FakeCode2Wav, FakeGenerator, FakeSpec
from tests.services.talker.stack import eventually, generate_all, speaker_cache, talker_stack

PCM = (np.cos(np.arange(12000) / 7) * 0.2).astype("<f4")


def stack(bundle, address):
    return talker_stack(
        [FakeCode2Wav("c2w")],
        bundle=bundle,
        generator_factory=FakeGenerator,
        spec_factory=FakeSpec,
        speaker_cache=address,
    )


async def test_prompt_is_computed_once_then_served_from_speaker_cache_by_content_key():
    clone = dict(
        task_type=tts_pb2.TASK_TYPE_VOICE_CLONE, reference_pcm_f32=PCM.tobytes(), reference_text="ref words"
    )
    async with speaker_cache() as (address, cache):
        first = FakeBundle()
        async with stack(first, address) as s:
            _, summary = await generate_all(s.stub, text="frames=2", **clone)
            assert summary.num_frames == 2 and first.compute_calls == 1
        key = voice_prompt_key(first.info.name, PCM.tobytes(), "ref words", False)
        stored = await cache.GetVoicePrompt(speaker_cache_pb2.GetVoicePromptRequest(key=key))
        assert (
            stored.found
            and stored.prompt.num_reference_frames == 3
            and stored.prompt.reference_text == "ref words"
        )

        second = FakeBundle()  # another talker replica: nothing cached locally
        async with stack(second, address) as s:
            _, summary = await generate_all(s.stub, text="frames=2", **clone)
        assert second.compute_calls == 0
        vp = second.specs[-1].voice_prompt
        torch.testing.assert_close(vp.ref_codes, torch.arange(48).reshape(3, 16))
        torch.testing.assert_close(vp.x_vector, torch.full((8,), float(PCM.mean())))
        assert vp.ref_text == "ref words" and not vp.x_vector_only
        c2w = s.replicas[0].servicer
        assert c2w.logs[0].prefix_frames == 3  # the cached reference codes prefix the decode


async def test_named_voice_is_loaded_from_speaker_cache():
    async with speaker_cache() as (address, cache):
        await cache.CreateVoice(
            speaker_cache_pb2.CreateVoiceRequest(
                voice=speaker_cache_pb2.StoredVoice(
                    name="narrator",
                    reference_pcm_f32=PCM.tobytes(),
                    sample_rate_hz=24000,
                    reference_text="ref words",
                )
            )
        )
        bundle = FakeBundle()
        async with stack(bundle, address) as s:
            _, summary = await generate_all(
                s.stub, text="frames=3", voice="narrator", task_type=tts_pb2.TASK_TYPE_VOICE_CLONE
            )
            assert summary.num_frames == 3 and bundle.compute_calls == 1
            assert bundle.specs[-1].voice_prompt.ref_text == "ref words"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate_all(
                    s.stub, text="frames=3", voice="nobody", task_type=tts_pb2.TASK_TYPE_VOICE_CLONE
                )
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value
            # It says where the voices are, and that OpenAI's preset names are not presets here.
            details = err.value.details()
            assert details.startswith(f"{UNKNOWN_VOICE} 'nobody': "), details
            assert "GET /v1/audio/voices" in details and "ListVoices" in details, details
            assert "alloy" in details and "unless one was stored under that name" in details, details


async def test_unreachable_speaker_cache_computes_locally_and_named_voices_are_unavailable():
    bundle = FakeBundle()
    async with stack(bundle, f"127.0.0.1:{free_port()}") as s:
        _, summary = await generate_all(
            s.stub, text="frames=2", reference_pcm_f32=PCM.tobytes(), x_vector_only=True
        )
        assert summary.num_frames == 2 and bundle.compute_calls == 1
        assert s.replicas[0].servicer.logs[0].prefix_frames == 0  # x-vector only: no ICL prefix
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, text="frames=2", voice="narrator")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "speaker_cache" in err.value.details()
        await eventually(lambda: s.generator.num_active == 0)


async def test_a_clip_sent_before_is_named_by_its_digest_alone():
    """A caller that sent a clip once sends only its reference_digest: a replica that holds the
    prompt (here from speaker_cache) uses it, computing nothing; a digest it has no prompt for fails
    before any audio with FAILED_PRECONDITION naming REFERENCE_NOT_CACHED; a malformed digest is an
    INVALID_ARGUMENT."""
    digest = reference_digest(PCM.tobytes(), "ref words", False)
    by_clip = dict(
        task_type=tts_pb2.TASK_TYPE_VOICE_CLONE, reference_pcm_f32=PCM.tobytes(), reference_text="ref words"
    )
    by_digest = dict(
        task_type=tts_pb2.TASK_TYPE_VOICE_CLONE, reference_digest=digest, reference_text="ref words"
    )
    async with speaker_cache() as (address, _):
        first = FakeBundle()
        async with stack(first, address) as s:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate_all(s.stub, text="frames=2", **by_digest)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert err.value.details().startswith(REFERENCE_NOT_CACHED)
            assert first.compute_calls == 0
            _, summary = await generate_all(s.stub, text="frames=2", **by_clip)
            assert summary.num_frames == 2 and first.compute_calls == 1
            # The same replica: from its own memory.
            _, summary = await generate_all(s.stub, text="frames=2", **by_digest)
            assert summary.num_frames == 2 and first.compute_calls == 1

        second = FakeBundle()  # another replica: from speaker_cache, by the digest's key
        async with stack(second, address) as s:
            _, summary = await generate_all(s.stub, text="frames=3", **by_digest)
            assert summary.num_frames == 3 and second.compute_calls == 0
            vp = second.specs[-1].voice_prompt
            torch.testing.assert_close(vp.ref_codes, torch.arange(48).reshape(3, 16))
            assert vp.ref_text == "ref words"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate_all(s.stub, text="frames=2", **{**by_digest, "reference_digest": "ABC"})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "reference_digest" in err.value.details()


def test_the_key_of_a_digest_is_the_key_of_its_clip():
    pcm = PCM.tobytes()
    for text, xvec in (("ref words", False), (None, True), ("ignored", True)):
        digest = reference_digest(pcm, text, xvec)
        assert is_reference_digest(digest)
        assert voice_prompt_key_for_digest("m", digest) == voice_prompt_key("m", pcm, text, xvec)
    assert reference_digest(pcm, "a", False) != reference_digest(pcm, "b", False)
    assert reference_digest(pcm, "a", True) == reference_digest(pcm, "b", True)
    assert not is_reference_digest("0" * 63) and not is_reference_digest("G" * 64)
