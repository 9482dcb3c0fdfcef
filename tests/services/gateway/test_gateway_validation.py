"""Request parsing and validation: every bad input is a clear InvalidArgument / NotFound."""

from __future__ import annotations

import base64

import pytest
from gateway_fakes import BASE, CUSTOM, DESIGN

from qtts.request.errors import InvalidArgument, NotFound
from services.gateway.http_body import decode_base64_audio
from services.gateway.http_request import parse_speech_body
from services.gateway.job import SamplingOptions, SpeechFields
from services.gateway.validation import RequestLimits, build_job, check_voice_name

LIMITS = RequestLimits(max_input_chars=50, max_new_frames_limit=100, max_ref_audio_bytes=1000)
AUDIO = b"RIFF0000WAVE"


def job(catalog=BASE, **kw):
    return build_job(SpeechFields(**{"text": "Hello.", **kw}), catalog, LIMITS)


def test_voice_clone_icl_and_xvector_jobs():
    j = job(reference_audio=AUDIO, reference_text=" ref text ", max_new_frames=8, language="English")
    assert (j.task, j.reference_text, j.x_vector_only, j.max_new_frames, j.language) == (
        "voice_clone",
        "ref text",
        False,
        8,
        "english",
    )
    assert j.request_id.startswith("req-") and j.sample_rate == 24000
    x = job(reference_audio=AUDIO, x_vector_only=True, reference_text="ignored")
    assert x.x_vector_only and x.reference_text == ""
    named = job(voice="alice")
    assert named.voice == "alice" and named.reference_audio is None


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"model": "tts-1"}, NotFound, "does not exist"),
        ({"text": "   "}, InvalidArgument, "non-empty"),
        ({"text": "x" * 51}, InvalidArgument, "limit is 50"),
        ({"reference_audio": AUDIO}, InvalidArgument, "ref_text"),
        ({"reference_audio": b"x" * 1001, "x_vector_only": True}, InvalidArgument, "limit"),
        ({}, InvalidArgument, "ref_audio"),
        ({"voice": "a", "task": "custom_voice"}, InvalidArgument, "not served"),
        ({"voice": "a", "task": "sing"}, InvalidArgument, "task_type must be"),
        ({"voice": "a", "language": "klingon"}, InvalidArgument, "unsupported language"),
        ({"voice": "a", "max_new_frames": 0}, InvalidArgument, "max_new_tokens"),
        ({"voice": "a", "max_new_frames": 101}, InvalidArgument, "max_new_tokens"),
        ({"voice": "a", "sample_rate": 4000}, InvalidArgument, "sample_rate"),
        ({"voice": "a", "sampling": SamplingOptions(top_p=0)}, InvalidArgument, "top_p"),
        ({"voice": "a", "sampling": SamplingOptions(temperature=-1)}, InvalidArgument, "temperature"),
        ({"voice": "a", "sampling": SamplingOptions(repetition_penalty=0)}, InvalidArgument, "repetition"),
    ],
)
def test_base_model_rejections(kw, exc, words):
    with pytest.raises(exc, match=words):
        job(**kw)


def test_custom_voice_and_voice_design():
    assert job(CUSTOM, voice="Vivian").voice == "vivian"
    with pytest.raises(NotFound, match="unknown speaker"):
        job(CUSTOM, voice="nobody")
    with pytest.raises(InvalidArgument, match="voice is required"):
        job(CUSTOM)
    with pytest.raises(InvalidArgument, match="only used for voice_clone"):
        job(CUSTOM, voice="ryan", reference_audio=AUDIO, reference_text="t")
    d = job(DESIGN, instructions="a deep voice", voice="ignored")
    assert (d.task, d.voice, d.instructions) == ("voice_design", "", "a deep voice")
    with pytest.raises(InvalidArgument, match="instructions"):
        job(DESIGN)


def test_temperature_zero_means_greedy():
    j = job(voice="a", sampling=SamplingOptions(temperature=0.0, seed=3))
    assert j.sampling.greedy and j.sampling.temperature is None and j.sampling.seed == 3


def test_parse_openai_body():
    audio_b64 = base64.b64encode(AUDIO).decode()
    fields, out = parse_speech_body(
        {
            "model": "m",
            "input": "hi",
            "voice": "v",
            "response_format": "WAV",
            "stream": True,
            "speed": 1,
            "ref_audio": f"data:audio/wav;base64,{audio_b64}",
            "ref_text": "r",
            "max_new_tokens": 12.0,
            "seed": 7,
            "temperature": 0.5,
            "top_k": 3,
            "sample_rate": 16000,
            "task_type": "voice_clone",
        }
    )
    assert fields.reference_audio == AUDIO and fields.max_new_frames == 12 and fields.sample_rate == 16000
    assert fields.sampling == SamplingOptions(temperature=0.5, top_k=3, seed=7)
    assert (out.response_format, out.stream, out.stream_format, out.streaming) == ("wav", True, "audio", True)
    _, sse = parse_speech_body({"input": "hi", "stream_format": "sse"})
    assert sse.streaming and sse.response_format == "mp3"


@pytest.mark.parametrize(
    "body, words",
    [
        ([], "JSON object"),
        ({}, "input is required"),
        ({"input": 3}, "input must be a string"),
        ({"input": "a", "speed": 0.1}, "speed must be in 0.25..4.0"),
        ({"input": "a", "speed": 5}, "speed must be in 0.25..4.0"),
        ({"input": "a", "response_format": "ogg"}, "response_format"),
        ({"input": "a", "stream_format": "ws"}, "stream_format"),
        ({"input": "a", "stream": "yes"}, "boolean"),
        ({"input": "a", "max_new_tokens": 2.5}, "integer"),
        ({"input": "a", "seed": True}, "seed"),
        ({"input": "a", "ref_audio": "@@not base64@@"}, "not valid base64"),
        ({"input": "a", "ref_audio": "https://example.com/a.wav"}, "not fetched"),
        ({"input": "a", "bogus": 1}, "unknown field"),
    ],
)
def test_parse_rejections(body, words):
    with pytest.raises(InvalidArgument, match=words):
        parse_speech_body(body)


def test_base64_forms():
    assert decode_base64_audio(base64.b64encode(b"abc").decode()) == b"abc"
    assert decode_base64_audio("data:audio/wav;base64,YWJj") == b"abc"
    with pytest.raises(InvalidArgument, match="base64 encoded"):
        decode_base64_audio("data:audio/wav,abc")
    with pytest.raises(InvalidArgument, match="empty"):
        decode_base64_audio("")


def test_long_reference_audio_is_decoded_once_and_failures_every_time(monkeypatch):
    """A speech request's clip text seen before is answered from the cache (the same bytes,
    without decoding); bad base64 is rejected each time it comes, short values are not cached,
    and uploads through plain `decode_base64_audio` are never kept."""
    from services.gateway import http_body

    monkeypatch.setattr(http_body, "_decoded", http_body.BoundedLru(max_cost=1 << 20, cost=len))
    decoded = []
    real = http_body.decode_base64_audio
    monkeypatch.setattr(
        http_body, "decode_base64_audio", lambda v, f="ref_audio": decoded.append(len(v)) or real(v, f)
    )
    decode = http_body.decode_reference_audio
    clip = bytes(range(256)) * 100  # 25.6 kB: its base64 is past DECODED_MIN_CHARS
    url = "data:audio/wav;base64," + base64.b64encode(clip).decode()
    assert len(url) >= http_body.DECODED_MIN_CHARS
    first, again = decode(url), decode(url)
    assert first == again == clip and len(decoded) == 1
    assert decode(base64.b64encode(clip[:-3]).decode()) == clip[:-3]  # another text
    assert len(decoded) == 2
    bad = "@" + url[1:]
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="base64"):
            decode(bad)
    assert len(decoded) == 4
    for _ in range(2):
        assert decode("YWJj") == b"abc"
    assert len(decoded) == 6 and len(http_body._decoded) == 2
    assert real(base64.b64encode(clip[::-1]).decode(), "audio") == clip[::-1]  # an upload
    assert len(http_body._decoded) == 2
    # bounded by the decoded bytes: a cache of one clip's size keeps the latest only
    monkeypatch.setattr(http_body, "_decoded", http_body.BoundedLru(max_cost=len(clip), cost=len))
    decode(url)
    decode(base64.b64encode(clip[::-1]).decode())
    assert len(http_body._decoded) == 1 and http_body._decoded.cost_used == len(clip)


def test_the_base64_cache_follows_the_reference_cache_flag(monkeypatch):
    """A gateway sized by `--ref-audio-cache-mb` keeps its clips' base64 decodes within a quarter
    of it, and none at 0: the flag bounds every clip the process keeps (the server sizes it:
    test_reference_cache)."""
    from services.gateway import http_body

    monkeypatch.setattr(http_body, "_decoded", http_body._decoded)  # restored after the test
    clip = bytes(range(256)) * 100
    url = base64.b64encode(clip).decode()
    http_body.size_decoded_cache(0)
    assert http_body._decoded is None and http_body.decode_reference_audio(url) == clip
    http_body.size_decoded_cache((1 << 20) // 4)
    assert http_body._decoded is not None and http_body._decoded.max_cost == 1 << 18
    assert http_body.decode_reference_audio(url) == clip and http_body._decoded.cost_used == len(clip)
    with pytest.raises(ValueError):
        http_body.size_decoded_cache(-1)


def test_voice_names():
    assert check_voice_name(" my-voice_1.v2 ") == "my-voice_1.v2"
    for bad in ("", "a b", "x" * 65, "../etc"):
        with pytest.raises(InvalidArgument):
            check_voice_name(bad)


def test_speed_and_g711_sample_rate_defaults():
    fields, out = parse_speech_body({"input": "hi", "speed": 4, "response_format": "MULAW"})
    assert (out.speed, out.response_format, fields.sample_rate) == (4.0, "mulaw", 8000)
    fields, out = parse_speech_body({"input": "hi", "response_format": "alaw", "sample_rate": 16000})
    assert fields.sample_rate == 16000  # refused later by the encoder check, naming sample_rate
    fields, out = parse_speech_body({"input": "hi"})
    assert out.speed == 1.0 and fields.sample_rate is None
