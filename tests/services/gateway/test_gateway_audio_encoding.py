"""Output encoders (pcm, streaming/complete wav, PyAV formats, G.711), resampling, time-stretch and
SSE framing."""

from __future__ import annotations

import base64
import io
import json
import struct
import wave

import av
import numpy as np
import pytest
from gateway_fakes import frame_pcm

from qtts.request.errors import InvalidArgument, NotFound, ResourceExhausted, openai_error_body
from services.gateway import sse
from services.gateway.audio_encoding import (
    MEDIA_TYPES,
    Resampler,
    TimeStretch,
    atempo_factors,
    make_encoder,
    wav_header,
)


def test_streaming_wav_header_has_unknown_sizes_and_audio_follows():
    enc = make_encoder("wav", 24000, streaming=True)
    first = enc.push(frame_pcm(0))
    assert first[:4] == b"RIFF" and first[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", first[4:8])[0] == 0xFFFFFFFF
    assert first[36:40] == b"data" and struct.unpack("<I", first[40:44])[0] == 0xFFFFFFFF
    assert first[44:] == frame_pcm(0)
    assert enc.push(frame_pcm(1)) == frame_pcm(1)  # header only once
    assert enc.finish() == b""


def test_complete_wav_is_readable_with_exact_sizes():
    enc = make_encoder("wav", 16000, streaming=False)
    assert enc.push(frame_pcm(0)) == b""
    enc.push(frame_pcm(1))
    data = enc.finish()
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (16000, 1, 2, 3840)
        assert w.readframes(3840) == frame_pcm(0) + frame_pcm(1)
    assert wav_header(16000, 10)[4:8] == struct.pack("<I", 46)


def test_pcm_passthrough_and_buffered():
    s = make_encoder("pcm", 24000, streaming=True)
    assert s.push(b"\x01\x00") == b"\x01\x00" and s.finish() == b""
    b = make_encoder("pcm", 24000, streaming=False)
    assert b.push(b"\x01\x00") == b"" and b.finish() == b"\x01\x00"


@pytest.mark.parametrize("fmt, codec", [("mp3", "mp3"), ("flac", "flac"), ("opus", "opus"), ("aac", "aac")])
@pytest.mark.parametrize("streaming", [True, False])
def test_compressed_formats_decode_back(fmt, codec, streaming):
    enc = make_encoder(fmt, 24000, streaming=streaming)
    parts = [enc.push(frame_pcm(i)) for i in range(10)]
    parts.append(enc.finish())
    data = b"".join(parts)
    if streaming and fmt in ("mp3", "aac", "flac"):
        assert parts[0] or parts[1], "a streaming encoder must hand out bytes before the end"
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        assert stream.codec_context.name.startswith(codec)
        samples = sum(f.samples for f in c.decode(stream))
    # Decoders may pad to their frame size and opus decodes at 48 kHz.
    expected = 10 * 1920 * (2 if fmt == "opus" else 1)
    assert expected <= samples <= expected + 4096


def test_opus_rejects_unsupported_rate():
    with pytest.raises(InvalidArgument, match="opus"):
        make_encoder("opus", 22050, streaming=True)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_streaming_resampler_output_length(rate):
    r = Resampler(24000, rate)
    out = b"".join(r.push(frame_pcm(i)) for i in range(5)) + r.flush()
    assert abs(len(out) // 2 - 5 * 1920 * rate / 24000) <= 2
    assert not r.passthrough


def test_native_rate_is_passthrough():
    r = Resampler(24000, 24000)
    assert r.passthrough and r.push(frame_pcm(0)) == frame_pcm(0) and r.flush() == b""


def _tone(seconds: float, rate: int = 24000, hz: float = 440.0) -> np.ndarray:
    return (np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate) * 8000).astype("<i2")


def _dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64) * np.hanning(samples.size)))
    return float(np.fft.rfftfreq(samples.size, 1 / rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_time_stretch_changes_duration_and_keeps_pitch(speed):
    tone = _tone(2.0)
    stretch = TimeStretch(24000, speed)
    chunks = [stretch.push(tone[i : i + 1920].tobytes()) for i in range(0, tone.size, 1920)]
    assert any(chunks[:-1]), "the stretch must hand out audio while the stream runs"
    out = np.frombuffer(b"".join(chunks) + stretch.flush(), dtype="<i2")
    assert abs(out.size / tone.size - 1 / speed) <= 0.05 / speed, out.size
    assert abs(_dominant_hz(out, 24000) - 440.0) <= 0.02 * 440.0
    assert stretch.flush() == b"" and stretch.push(tone[:100].tobytes()) == b""


def test_atempo_chains_beyond_one_instance():
    assert atempo_factors(0.25) == [0.5, 0.5] and atempo_factors(4.0) == [2.0, 2.0]
    assert atempo_factors(1.5) == [1.5] and atempo_factors(3.0) == [2.0, 1.5]
    for bad in (0.1, 5.0):
        with pytest.raises(InvalidArgument) as err:
            atempo_factors(bad)
        assert err.value.param == "speed"


@pytest.mark.parametrize("speed", [0.25, 4.0])
def test_resampler_stretches_then_resamples(speed):
    r = Resampler(24000, 16000, speed)
    assert not r.passthrough
    out = b"".join(r.push(frame_pcm(i)) for i in range(25)) + r.flush()
    expected = 25 * 1920 * 16000 / 24000 / speed
    assert abs(len(out) // 2 - expected) <= 0.05 * expected


@pytest.mark.parametrize("fmt, codec", [("mulaw", "pcm_mulaw"), ("alaw", "pcm_alaw")])
@pytest.mark.parametrize("streaming", [True, False])
def test_g711_is_raw_8khz_and_decodes_back(fmt, codec, streaming):
    enc = make_encoder(fmt, 8000, streaming=streaming)
    tone = _tone(1.0, rate=8000)
    parts = [enc.push(tone[i : i + 400].tobytes()) for i in range(0, tone.size, 400)] + [enc.finish()]
    if streaming:
        assert all(len(p) == 400 for p in parts[:-1]), "one byte a sample, sent as it is encoded"
    else:
        assert not any(parts[:-1])
    data = b"".join(parts)
    assert len(data) == tone.size and enc.media_type == MEDIA_TYPES[fmt]
    with av.open(io.BytesIO(data), format=fmt, options={"sample_rate": "8000", "ch_layout": "mono"}) as c:
        stream = c.streams.audio[0]
        assert stream.codec_context.name == codec and stream.rate == 8000
        pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(stream)])
    assert pcm.size == tone.size and np.abs(pcm.astype(int) - tone).max() < 300  # G.711's step at 8000


@pytest.mark.parametrize("fmt", ["mulaw", "alaw"])
def test_g711_rejects_other_rates(fmt):
    with pytest.raises(InvalidArgument) as err:
        make_encoder(fmt, 16000, streaming=True)
    assert err.value.param == "sample_rate"


def _events(raw: bytes) -> list[dict]:
    assert raw.endswith(b"\n\n")
    return [json.loads(block.removeprefix(b"data: ")) for block in raw.strip().split(b"\n\n")]


def test_sse_framing():
    delta = _events(sse.audio_delta(b"\x00\x01\x02"))
    assert delta == [{"type": "speech.audio.delta", "audio": base64.b64encode(b"\x00\x01\x02").decode()}]
    done = _events(sse.audio_done(5, 12, finish_reason="length"))[0]
    assert done["type"] == "speech.audio.done"
    assert done["usage"] == {"input_tokens": 5, "output_tokens": 12, "total_tokens": 17}
    err = _events(sse.error_event(InvalidArgument("bad")))[0]
    assert err["type"] == "error" and err["error"]["message"] == "bad"
    assert err["error"]["type"] == "invalid_request_error"


def test_openai_error_shape():
    for exc, kind, param, code in [
        (InvalidArgument("x", param="input"), "invalid_request_error", "input", "invalid_value"),
        (NotFound("x"), "not_found_error", None, "not_found"),
        (ResourceExhausted("x", 3), "rate_limit_error", None, "rate_limit_exceeded"),
    ]:
        body = openai_error_body(exc)
        assert body == {"error": {"message": "x", "type": kind, "param": param, "code": code}}
    assert openai_error_body(RuntimeError("secret")) == {
        "error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    }
    assert np.frombuffer(frame_pcm(0), "<i2").size == 1920
