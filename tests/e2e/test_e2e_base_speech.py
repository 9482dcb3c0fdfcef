"""Voice clone through the whole stack (tiny Base model): HTTP audio, SSE, gRPC, errors, SDK."""

from __future__ import annotations

import base64
import json

import grpc
import httpx
import openai  # a test dependency (requirements-test.txt): missing, the suite fails loudly
import pytest
from e2e_helpers import FRAME, FRAME_BYTES, REF_B64, REF_TEXT, REF_WAV, wav_frames

from qtts.pb import tts_pb2, tts_pb2_grpc

pytestmark = pytest.mark.e2e

MAX_FRAMES = 10


def clone_body(icl: bool, **kw) -> dict:
    body = {
        "input": "Hello there, nice to meet you.",
        "voice": "caller",
        "ref_audio": REF_B64,
        "max_new_tokens": MAX_FRAMES,
        "temperature": 0,
        "response_format": "wav",
    }
    body.update({"ref_text": REF_TEXT} if icl else {"x_vector_only_mode": True})
    return {**body, **kw}


@pytest.mark.parametrize("icl", [True, False], ids=["icl", "x_vector_only"])
def test_voice_clone_streaming_and_non_streaming(stack, icl):
    with httpx.Client(base_url=stack.http_url, timeout=120) as c:
        r = c.post("/v1/audio/speech", json=clone_body(icl, stream=False))
        assert r.status_code == 200, r.text
        frames = int(r.headers["x-tts-num-frames"])
        assert 1 <= frames <= MAX_FRAMES
        assert r.headers["x-tts-finish-reason"] in ("stop", "length")
        if frames == MAX_FRAMES:
            assert r.headers["x-tts-finish-reason"] == "length"
        assert wav_frames(r.content) == frames * FRAME

        with c.stream(
            "POST", "/v1/audio/speech", json=clone_body(icl, stream=True, response_format="pcm")
        ) as s:
            assert s.status_code == 200
            pcm = b"".join(s.iter_bytes())
        assert len(pcm) % FRAME_BYTES == 0 and len(pcm) == frames * FRAME_BYTES

        with c.stream("POST", "/v1/audio/speech", json=clone_body(icl)) as s:  # streams by default
            wav = b"".join(s.iter_bytes())
        assert wav[4:8] == b"\xff\xff\xff\xff" and len(wav) - 44 == frames * FRAME_BYTES

        r = c.post("/v1/audio/speech", json=clone_body(icl, stream_format="sse", response_format="pcm"))
        events = [json.loads(block[len("data: ") :]) for block in r.text.split("\n\n") if block]
        audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"]["output_tokens"] == frames and len(audio) == frames * FRAME_BYTES
        usage = events[-1]["usage"]
        assert 0 < usage["input_tokens"] and usage["total_tokens"] == usage["input_tokens"] + frames


def test_grpc_synthesize_has_ids_sequence_and_matching_summary(stack):
    req = tts_pb2.SynthesizeRequest(
        request_id="e2e-grpc-1",
        text="Hello over gRPC.",
        reference_audio=REF_WAV,
        reference_text=REF_TEXT,
        max_new_frames=8,
        sampling=tts_pb2.SamplingParams(greedy=True),
        audio_encoding=tts_pb2.AUDIO_ENCODING_PCM_S16LE,
    )
    with grpc.insecure_channel(stack.grpc_address) as channel:
        msgs = list(tts_pb2_grpc.TextToSpeechServiceStub(channel).Synthesize(req, timeout=120))
    assert {m.request_id for m in msgs} == {"e2e-grpc-1"}
    assert [m.sequence_number for m in msgs] == list(range(len(msgs)))
    summary = msgs[-1].summary
    pcm = b"".join(m.audio.audio for m in msgs[:-1])
    assert 1 <= summary.num_frames <= 8
    assert len(pcm) == summary.num_frames * FRAME_BYTES == summary.num_samples * 2
    assert summary.finish_reason in (tts_pb2.FINISH_REASON_STOP, tts_pb2.FINISH_REASON_LENGTH)
    assert summary.num_input_tokens > 0  # the model tokenizer's count of the input text


def test_bad_input_gets_openai_errors_and_the_service_keeps_serving(stack):
    bad_audio = base64.b64encode(b"this is not audio at all" * 10).decode()
    cases = [
        ({"model": "no-such-model"}, 404, "model"),
        ({"input": ""}, 400, "input"),
        ({"ref_audio": "%%%"}, 400, "ref_audio"),
        ({"ref_audio": bad_audio}, 400, "ref_audio"),
        ({"ref_text": None, "x_vector_only_mode": False}, 400, "ref_text"),
        ({"speed": 5}, 400, "speed"),
        ({"input": "x" * 5000}, 400, "input"),
        ({"task_type": "voice_design", "instructions": "calm"}, 400, "task_type"),
        # The talker finds the voice missing; the gateway names the field.
        ({"ref_audio": None, "voice": "no-such-voice"}, 404, "voice"),
        ({"ref_audio": None, "voice": "alloy"}, 404, "voice"),
    ]
    with httpx.Client(base_url=stack.http_url, timeout=120) as c:
        for override, status, param in cases:
            body = {k: v for k, v in {**clone_body(True), **override}.items() if v is not None}
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == status, (override, r.text)
            error = r.json()["error"]
            assert error["param"] == param and isinstance(error["code"], str), error
            assert error["message"] and error["type"], error
            if status == 404 and param == "voice":
                assert "GET /v1/audio/voices" in error["message"] and "alloy" in error["message"], error
        assert c.get("/health").status_code == 200
        r = c.post("/v1/audio/speech", json=clone_body(False, max_new_tokens=4, stream=False))
        assert r.status_code == 200 and wav_frames(r.content) == int(r.headers["x-tts-num-frames"]) * FRAME


def test_openai_sdk(stack):
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    extra = {"ref_audio": REF_B64, "x_vector_only_mode": True, "max_new_tokens": 6, "temperature": 0}
    audio = client.audio.speech.create(
        model=model,
        voice="caller",
        input="Hello from the SDK.",
        response_format="wav",
        extra_body={**extra, "stream": False},
    )
    assert wav_frames(audio.content) % FRAME == 0 and wav_frames(audio.content) > 0
    # No extra streaming field: the body streams by default, as OpenAI's does.
    streamed = client.audio.speech.create(
        model=model, voice="caller", input="Hello from the SDK.", response_format="wav", extra_body=extra
    )
    assert streamed.content[4:8] == b"\xff\xff\xff\xff" and streamed.content[44:] == audio.content[44:]
    with client.audio.speech.with_streaming_response.create(
        model=model,
        voice="caller",
        input="Hello from the SDK.",
        response_format="pcm",
        extra_body=extra,
    ) as response:
        pcm = b"".join(response.iter_bytes())
    assert len(pcm) == wav_frames(audio.content) * 2
    with pytest.raises(openai.NotFoundError):
        client.audio.speech.create(model="tts-1", voice="caller", input="x", extra_body=extra)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model=model, voice="caller", input="", extra_body=extra)
    assert info.value.body["message"]
