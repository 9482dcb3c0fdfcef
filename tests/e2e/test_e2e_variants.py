"""CustomVoice and VoiceDesign through their own talker + gateway on the shared stages."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from e2e_helpers import FRAME, FRAME_BYTES, REF_B64, wav_frames

pytestmark = pytest.mark.e2e


def _speaker(c: httpx.Client) -> str:
    presets = [v["name"] for v in c.get("/v1/audio/voices").json()["voices"] if v["kind"] == "preset"]
    assert presets
    return presets[0]


def _check_variant(url: str, body: dict) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/audio/speech", json={**body, "response_format": "wav", "stream": False})
        assert r.status_code == 200, r.text
        frames = int(r.headers["x-tts-num-frames"])
        assert 1 <= frames <= body["max_new_tokens"] and wav_frames(r.content) == frames * FRAME
        with c.stream(
            "POST", "/v1/audio/speech", json={**body, "stream": True, "response_format": "pcm"}
        ) as s:
            pcm = b"".join(s.iter_bytes())
        assert len(pcm) == frames * FRAME_BYTES
        r = c.post("/v1/audio/speech", json={**body, "stream_format": "sse", "response_format": "pcm"})
        events = [json.loads(b[len("data: ") :]) for b in r.text.split("\n\n") if b]
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert events[-1]["usage"]["output_tokens"] * FRAME_BYTES == len(audio) > 0


def test_custom_voice(variant_gateways):
    gw = variant_gateways["custom_voice"]
    with httpx.Client(base_url=gw.http_url, timeout=60) as c:
        speaker = _speaker(c)
        assert c.get("/v1/models").json()["data"][0]["model_type"] == "custom_voice"
        r = c.post("/v1/audio/speech", json={"input": "hi", "voice": "nobody-here"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = c.post(
            "/v1/audio/speech",
            json={"input": "hi", "voice": speaker, "ref_audio": REF_B64, "x_vector_only_mode": True},
        )
        assert r.status_code == 400
        r = c.post("/v1/audio/speech", json={"input": "hi", "voice": speaker, "task_type": "voice_clone"})
        assert r.status_code == 400 and "not served" in r.json()["error"]["message"]
    _check_variant(
        gw.http_url,
        {
            "input": "Hello, I am a preset speaker.",
            "voice": speaker,
            "language": "english",
            "max_new_tokens": 8,
            "temperature": 0,
        },
    )


def test_voice_design(variant_gateways):
    gw = variant_gateways["voice_design"]
    with httpx.Client(base_url=gw.http_url, timeout=60) as c:
        r = c.post("/v1/audio/speech", json={"input": "hi", "voice": "x"})
        assert r.status_code == 400 and "instructions" in r.json()["error"]["message"]
    _check_variant(
        gw.http_url,
        {
            "input": "Hello, my voice was designed.",
            "voice": "unused",
            "instructions": "A cheerful young voice, speaking fast.",
            "max_new_tokens": 8,
            "temperature": 0,
        },
    )


def test_vllm_omni_bodies_with_the_variants_own_task_names(stack, variant_gateways):
    """Clients written for vLLM-Omni send task_type as the model variants name themselves."""
    base = {
        "input": "Hello from a vLLM-Omni client.",
        "max_new_tokens": 8,
        "temperature": 0,
        "response_format": "wav",
        "stream": False,
    }
    with httpx.Client(base_url=stack.http_url, timeout=120) as c:
        r = c.post(
            "/v1/audio/speech",
            json={
                **base,
                "task_type": "Base",
                "ref_audio": REF_B64,
                "ref_text": "This is the reference clip.",
                "language": "en",
            },
        )
        assert r.status_code == 200, r.text
        assert wav_frames(r.content) == int(r.headers["x-tts-num-frames"]) * FRAME > 0
    gw = variant_gateways["custom_voice"]
    with httpx.Client(base_url=gw.http_url, timeout=120) as c:
        speaker = _speaker(c)
        r = c.post("/v1/audio/speech", json={**base, "task_type": "CustomVoice", "speaker": speaker})
        assert r.status_code == 200, r.text
        assert wav_frames(r.content) == int(r.headers["x-tts-num-frames"]) * FRAME > 0


@pytest.mark.parametrize("fmt, codec", [("mulaw", "pcm_mulaw"), ("alaw", "pcm_alaw")])
def test_g711_streams_at_8_khz_and_decodes_back(stack, fmt, codec):
    import av

    body = {
        "input": "Telephony.",
        "ref_audio": REF_B64,
        "x_vector_only_mode": True,
        "max_new_tokens": 10,
        "temperature": 0,
        "response_format": fmt,
        "voice": "caller",
    }
    with (
        httpx.Client(base_url=stack.http_url, timeout=120) as c,
        c.stream("POST", "/v1/audio/speech", json=body) as s,
    ):
        assert s.status_code == 200
        data = b"".join(s.iter_bytes())
    assert len(data) == 10 * 640  # 80 ms at 8 kHz, one byte a sample
    codec_ctx = av.CodecContext.create(codec, "r")
    codec_ctx.sample_rate, codec_ctx.layout = 8000, "mono"
    decoded = sum(f.samples for p in [av.Packet(data)] for f in codec_ctx.decode(p))
    assert decoded == len(data)
