"""The official `openai` SDK, unmodified, against the real processes of the stack (tiny Base model):
every response format decoded back with PyAV, a long clip streaming while it is synthesised, the
speed factor, and a voice created, spoken by id and deleted."""

from __future__ import annotations

import io

import av  # a runtime dependency (the gateway decodes clips with it)
import openai
import pytest
from e2e_helpers import REF_B64, REF_TEXT, REF_WAV, scrape

pytestmark = pytest.mark.e2e

FRAMES = 25  # 2 s of audio at 12.5 frames a second
FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]


def client_for(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


def duration_s(data: bytes, fmt: str) -> float:
    """Seconds of audio in `data`, decoded with PyAV (raw pcm: 24 kHz s16le mono)."""
    if fmt == "pcm":
        return len(data) / 2 / 24000
    samples, rate = 0, None
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate
    assert rate, f"no audio decoded from the {fmt} body"
    return samples / rate


CLONE = {"ref_audio": REF_B64, "x_vector_only_mode": True, "max_new_tokens": FRAMES, "temperature": 0}


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_through_create_and_with_streaming_response(stack, fmt):
    client = client_for(stack)
    model = client.models.list().data[0].id
    whole = client.audio.speech.create(
        model=model, voice="caller", input="Every format decodes.", response_format=fmt, extra_body=CLONE
    ).content
    with client.audio.speech.with_streaming_response.create(
        model=model, voice="caller", input="Every format decodes.", response_format=fmt, extra_body=CLONE
    ) as response:
        streamed = b"".join(response.iter_bytes())
    expected = FRAMES * 0.08
    for body in (whole, streamed):
        # Lossy codecs pad to their frame size (AAC 1024, Opus 960 samples; mp3 a priming delay).
        assert abs(duration_s(body, fmt) - expected) <= 0.06 + 0.01 * expected, fmt


def test_a_long_clip_streams_while_it_is_synthesised_with_no_streaming_field(stack):
    """A stored voice and a long text, no streaming field: the first bytes arrive while the gateway
    still has the stream running, and the clip is at least 20 s long. The random tiny model may end
    speech anywhere, so a length floor (min_new_tokens) keeps the clip long."""
    client = client_for(stack)
    model = client.models.list().data[0].id
    consent = client.audio.voice_consents.create(
        name="Long", language="en-US", recording=("consent.wav", REF_WAV, "audio/wav")
    )
    voice = client.audio.voices.create(
        name="long-voice", consent=consent.id, audio_sample=("ref.wav", REF_WAV, "audio/wav")
    )
    # About 24 s of audio: the tiny model's default length follows the text (no length field).
    text = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 7)
    metrics_port = stack["gateway"].spec.metrics_port
    try:
        with client.audio.speech.with_streaming_response.create(
            model=model,
            voice={"id": voice.id},
            input=text,
            response_format="pcm",
            extra_body={"min_new_tokens": 260},
        ) as response:
            chunks = response.iter_bytes()
            first = next(chunks)
            running = scrape(metrics_port).get("tts_gateway_active_streams", 0.0)
            rest = b"".join(chunks)
        assert first and running >= 1  # audio reached us before synthesis ended
        assert duration_s(first + rest, "pcm") >= 20.0
    finally:
        client.audio.voices.delete(voice.id)


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_the_duration_by_its_factor(stack, speed):
    client = client_for(stack)
    model = client.models.list().data[0].id
    body = {**CLONE, "max_new_tokens": 50, "seed": 3}
    normal = client.audio.speech.create(
        model=model, voice="caller", input="Speed changes the length.", response_format="wav", extra_body=body
    ).content
    changed = client.audio.speech.create(
        model=model,
        voice="caller",
        input="Speed changes the length.",
        response_format="wav",
        speed=speed,
        extra_body=body,
    ).content
    ratio = duration_s(changed, "wav") / duration_s(normal, "wav")
    assert abs(ratio - 1 / speed) <= 0.05 / speed


def test_voice_created_spoken_by_id_and_deleted_with_the_sdk(stack):
    client = client_for(stack)
    model = client.models.list().data[0].id
    consent = client.audio.voice_consents.create(
        name="Speaker", language="en-US", recording=("consent.wav", REF_WAV, "audio/wav")
    )
    voice = client.audio.voices.create(
        name="sdk-e2e",
        consent=consent.id,
        audio_sample=("ref.wav", REF_WAV, "audio/wav"),
        extra_body={"ref_text": REF_TEXT},
    )
    assert (voice.id, voice.object) == ("sdk-e2e", "audio.voice")
    audio = client.audio.speech.create(
        model=model,
        voice={"id": voice.id},
        input="Spoken by id.",
        response_format="wav",
        extra_body={"max_new_tokens": FRAMES, "min_new_tokens": FRAMES},  # sampled: EOS may come early
    ).content
    assert abs(duration_s(audio, "wav") - FRAMES * 0.08) < 0.01
    deleted = client.audio.voices.delete(voice.id)
    assert (deleted.id, deleted.deleted) == ("sdk-e2e", True)
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model=model, voice={"id": voice.id}, input="Gone.", response_format="wav")
