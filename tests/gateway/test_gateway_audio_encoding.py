"""Output encoders (pcm, streaming/complete wav, PyAV formats), resampling and SSE framing."""

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

from qtts.errors import InvalidArgument, NotFound, ResourceExhausted, openai_error_body
from services.gateway import sse
from services.gateway.audio_encoding import Resampler, make_encoder, wav_header


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
    for exc, kind, param, code in [(InvalidArgument("x", param="input"), "invalid_request_error", "input",
                                    "invalid_value"),
                                   (NotFound("x"), "not_found_error", None, "not_found"),
                                   (ResourceExhausted("x", 3), "rate_limit_error", None, "rate_limit_exceeded")]:
        body = openai_error_body(exc)
        assert body == {"error": {"message": "x", "type": kind, "param": param, "code": code}}
    assert openai_error_body(RuntimeError("secret")) == {"error": {
        "message": "internal server error", "type": "server_error", "param": None, "code": None}}
    assert np.frombuffer(frame_pcm(0), "<i2").size == 1920
