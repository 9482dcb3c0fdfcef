"""The official `openai` SDK, unmodified, against the HTTP app with a fake talker."""

from __future__ import annotations

import base64

import openai
import pytest
from gateway_fakes import FRAME, build_gateway, frame_pcm, serve_http, wav_bytes

REF = base64.b64encode(wav_bytes()).decode()
CLONE = {"ref_audio": REF, "x_vector_only_mode": True}


async def test_with_streaming_response_gets_bytes_while_the_talker_runs():
    async with serve_http(build_gateway(frames=30, chunk=1, delay_s=0.01)) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        async with client.audio.speech.with_streaming_response.create(
            model="tiny-base",
            voice="any",
            input="Hello from the SDK.",
            response_format="pcm",
            extra_body=CLONE,
        ) as response:
            chunks = response.iter_bytes()
            first = await chunks.__anext__()
            assert first and gw.talker.active == 1 and gw.talker.completed == 0
            pcm = first + b"".join([chunk async for chunk in chunks])
        assert pcm == frame_pcm(0, 30) and len(pcm) == 30 * FRAME * 2
        assert gw.talker.completed == 1 and gw.synth.admission.active == 0
        await client.close()


async def test_custom_voice_object():
    async with serve_http(build_gateway(frames=2)) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        audio = await client.audio.speech.create(
            model="tiny-base", voice={"id": "stored"}, input="Hi.", response_format="pcm", extra_body=CLONE
        )
        assert audio.content == frame_pcm(0, 2) and gw.talker.jobs[0].voice == "stored"
        await client.close()


async def test_voices_create_with_audio_sample_and_consent_then_speak_by_id():
    async with serve_http(build_gateway(frames=2)) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        consent = await client.audio.voice_consents.create(
            name="Speaker", language="en-US", recording=("consent.wav", wav_bytes(), "audio/wav")
        )
        await client.audio.voices.create(
            name="sdk-voice",
            consent=consent.id,
            audio_sample=("ref.wav", wav_bytes(), "audio/wav"),
            extra_body={"ref_text": "Hello."},
        )
        assert gw.voices.voices["sdk-voice"].reference_text == "Hello."
        audio = await client.audio.speech.create(
            model="tiny-base", voice={"id": "sdk-voice"}, input="Hi.", response_format="pcm"
        )
        assert audio.content == frame_pcm(0, 2) and gw.talker.jobs[0].voice == "sdk-voice"
        await client.close()


async def test_voices_create_speak_by_id_and_delete_with_the_sdk_unmodified():
    # No transcript and no extra fields: the voice is x-vector only (cloned from the speaker embedding).
    async with serve_http(build_gateway(frames=2)) as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        consent = await client.audio.voice_consents.create(
            name="Speaker", language="en-US", recording=("consent.wav", wav_bytes(), "audio/wav")
        )
        voice = await client.audio.voices.create(
            name="plain", consent=consent.id, audio_sample=("ref.wav", wav_bytes(), "audio/wav")
        )
        assert (voice.id, voice.name, voice.object, voice.type) == (
            "plain",
            "plain",
            "audio.voice",
            "audio_sample",
        )
        assert voice.created_at > 0 and gw.voices.voices["plain"].x_vector_only
        audio = await client.audio.speech.create(
            model="tiny-base", voice={"id": voice.id}, input="Hi.", response_format="pcm"
        )
        assert audio.content == frame_pcm(0, 2) and gw.talker.jobs[0].voice == "plain"
        deleted = await client.audio.voices.delete(voice.id)
        assert (deleted.id, deleted.object, deleted.deleted) == ("plain", "audio.voice.deleted", True)
        assert "plain" not in gw.voices.voices
        with pytest.raises(openai.NotFoundError):
            await client.audio.voices.delete(voice.id)
        await client.close()
