"""The HTTP API on a real uvicorn server with a fake talker: audio, SSE, errors, admission, cancel."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import av
import httpx
import pytest
from gateway_fakes import BASE, CUSTOM, DESIGN, FRAME, build_gateway, frame_pcm, serve_http, wav_bytes

from qtts.request.errors import NotFound, Unavailable
from services.gateway.audio_encoding import MEDIA_TYPES

REF = base64.b64encode(wav_bytes()).decode()


def body(**kw) -> dict:
    return {
        "model": "tiny-base",
        "input": "Hello there.",
        "voice": "any",
        "ref_audio": REF,
        "x_vector_only_mode": True,
        "response_format": "pcm",
        **kw,
    }


def expected_pcm(frames: int) -> bytes:
    return frame_pcm(0, frames)


async def test_non_streaming_wav_has_headers_and_whole_frames():
    async with serve_http(build_gateway(frames=5)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body(response_format="wav", stream=False))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "audio/wav"
        assert r.headers["x-tts-num-frames"] == "5" and r.headers["x-tts-finish-reason"] == "length"
        assert r.headers["x-tts-code2wav-replica"] == "fake-replica"
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() == 5 * FRAME and w.readframes(5 * FRAME) == expected_pcm(5)
        job = gw.talker.jobs[0]
        assert (
            job.x_vector_only and job.reference_pcm is not None and job.reference_pcm.dtype.name == "float32"
        )


async def test_streaming_pcm_and_wav_bytes_as_produced():
    async with serve_http(build_gateway(frames=6, chunk=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        async with c.stream("POST", "/v1/audio/speech", json=body(stream=True)) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
            pcm = b"".join([chunk async for chunk in r.aiter_raw()])
        assert pcm == expected_pcm(6)
        r = await c.post("/v1/audio/speech", json=body(stream=True, response_format="wav"))
        assert r.content[4:8] == b"\xff\xff\xff\xff" and r.content[44:] == expected_pcm(6)
        assert gw.talker.completed == 2 and gw.synth.admission.active == 0


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "flac", "opus", "aac"])
async def test_every_format_streams_by_default(fmt):
    # As OpenAI's API: no `stream` field, and the first bytes arrive while the talker still runs.
    gw0 = build_gateway(frames=40, chunk=2, delay_s=0.01)
    async with serve_http(gw0) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        payload = body(response_format=fmt)
        if fmt == "mp3":
            del payload["response_format"]  # OpenAI's default format
        async with c.stream("POST", "/v1/audio/speech", json=payload) as r:
            assert r.status_code == 200 and r.headers["content-type"] == MEDIA_TYPES[fmt]
            chunks = r.aiter_raw()
            parts = [await chunks.__anext__()]
            assert gw.talker.active == 1 and gw.talker.completed == 0
            parts += [chunk async for chunk in chunks]
        data = b"".join(parts)
        assert gw.talker.completed == 1 and gw.synth.admission.active == 0
    if fmt == "pcm":
        assert data == expected_pcm(40)
        return
    if fmt == "wav":
        assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff" and data[44:] == expected_pcm(40)
        return
    with av.open(io.BytesIO(data)) as container:
        seconds = sum(f.samples / f.sample_rate for f in container.decode(audio=0))
    assert abs(seconds - 40 * FRAME / 24000) < 0.1, seconds


async def test_sse_deltas_and_done_with_usage():
    async with serve_http(build_gateway(frames=4, chunk=1)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body(stream_format="sse"))
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line]
        deltas = [e for e in events if e["type"] == "speech.audio.delta"]
        assert len(deltas) == 4
        assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == expected_pcm(4)
        assert events[-1]["type"] == "speech.audio.done"
        assert events[-1]["usage"]["output_tokens"] == 4 and events[-1]["finish_reason"] == "length"
        # input_tokens is the talker's token count (the fake: words), not a character count.
        words = len(body()["input"].split())
        assert events[-1]["usage"]["input_tokens"] == words != len(body()["input"])
        assert events[-1]["usage"]["total_tokens"] == words + 4


async def test_error_after_first_byte_is_an_sse_error_event():
    gw0 = build_gateway(frames=4, chunk=1, error_after_first=Unavailable("code2wav went away"))
    async with serve_http(gw0) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body(stream_format="sse"))
        events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line]
        assert [e["type"] for e in events] == ["speech.audio.delta", "error"]
        assert events[1]["error"]["message"] == "code2wav went away"
        assert events[1]["error"]["code"] == "unavailable" and events[1]["error"]["param"] is None
        assert gw.synth.admission.active == 0


async def test_resampled_output_rate():
    async with serve_http(build_gateway(frames=5)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/audio/speech", json=body(response_format="wav", sample_rate=16000, stream=False)
        )
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getframerate() == 16000 and abs(w.getnframes() - 5 * 1280) <= 2


@pytest.mark.parametrize("stream", [None, False])
async def test_speed_time_stretches_the_output(stream):
    async with serve_http(build_gateway(frames=40, chunk=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        sizes = {}
        for speed in (1.0, 2.0, 0.5):
            extra = {} if stream is None else {"stream": stream}
            r = await c.post("/v1/audio/speech", json=body(speed=speed, **extra))
            assert r.status_code == 200, r.text
            sizes[speed] = len(r.content) // 2
        assert sizes[1.0] == 40 * FRAME
        assert abs(sizes[2.0] / sizes[1.0] - 0.5) <= 0.025 and abs(sizes[0.5] / sizes[1.0] - 2.0) <= 0.1, (
            sizes
        )
        assert gw.synth.admission.active == 0


@pytest.mark.parametrize(
    "fmt, codec, media", [("mulaw", "pcm_mulaw", "audio/basic"), ("alaw", "pcm_alaw", "audio/x-alaw-basic")]
)
async def test_g711_streams_raw_at_8khz(fmt, codec, media):
    async with serve_http(build_gateway(frames=20, chunk=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        async with c.stream("POST", "/v1/audio/speech", json=body(response_format=fmt)) as r:
            assert r.status_code == 200 and r.headers["content-type"] == media
            assert r.headers["x-tts-sample-rate"] == "8000"
            data = b"".join([chunk async for chunk in r.aiter_raw()])
    with av.open(io.BytesIO(data), format=fmt, options={"sample_rate": "8000", "ch_layout": "mono"}) as cont:
        stream = cont.streams.audio[0]
        assert stream.codec_context.name == codec and stream.rate == 8000
        samples = sum(f.samples for f in cont.decode(stream))
    assert abs(samples - 20 * FRAME / 3) <= FRAME / 3  # 20 frames of 80 ms, within one frame


async def test_openai_shaped_errors_and_service_keeps_serving():
    async with serve_http(build_gateway()) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        cases = [
            (body(model="tts-1"), 404, "model", "not_found"),
            (body(input=""), 400, "input", "invalid_value"),
            (body(ref_audio="!!!"), 400, "ref_audio", "invalid_value"),
            (body(ref_audio=base64.b64encode(b"not audio").decode()), 400, "ref_audio", "invalid_value"),
            (body(x_vector_only_mode=False), 400, "ref_text", "invalid_value"),
            (body(speed=0.1), 400, "speed", "invalid_value"),
            (body(speed=5), 400, "speed", "invalid_value"),
            (body(input="x" * 201), 400, "input", "invalid_value"),
            (body(task_type="custom_voice"), 400, "task_type", "invalid_value"),
            (body(response_format="ogg"), 400, "response_format", "invalid_value"),
            (body(response_format="opus", sample_rate=22050), 400, "sample_rate", "invalid_value"),
            (body(response_format="mulaw", sample_rate=16000), 400, "sample_rate", "invalid_value"),
            (body(temperature="hot"), 400, "temperature", "invalid_value"),
            (body(top_p=2.0), 400, "top_p", "invalid_value"),
            (body(max_new_tokens=0), 400, "max_new_tokens", "invalid_value"),
            (body(language="klingon"), 400, "language", "invalid_value"),
            (body(voice={"name": "x"}), 400, "voice", "invalid_value"),
            (body(bogus=1, zzz=2), 400, "bogus", "invalid_value"),
            ({"voice": "any"}, 400, "input", "invalid_value"),
        ]
        for payload, status, param, code in cases:
            r = await c.post("/v1/audio/speech", json=payload)
            assert r.status_code == status, (payload, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, code), (payload, err)
            assert err["message"] and err["type"]
        r = await c.post(
            "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] is None and r.json()["error"]["code"] == "invalid_value"
        err = (await c.get("/v1/nothing")).json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("not_found_error", "not_found", None)
        assert gw.talker.jobs == []  # nothing reached the talker
        assert (await c.post("/v1/audio/speech", json=body())).status_code == 200


async def test_voice_as_a_name_or_an_openai_id_object():
    async with serve_http(build_gateway(CUSTOM, frames=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        for voice in ("vivian", {"id": "ryan"}):
            r = await c.post(
                "/v1/audio/speech", json={"input": "hi", "voice": voice, "response_format": "pcm"}
            )
            assert r.status_code == 200, r.text
        assert [job.voice for job in gw.talker.jobs] == ["vivian", "ryan"]
        for bad in ({}, {"id": ""}, {"id": 3}, {"name": "ryan"}, {"id": "ryan", "extra": 1}, ["ryan"], 7):
            r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": bad, "response_format": "pcm"})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("voice "), (bad, r.text)
        assert len(gw.talker.jobs) == 2


async def test_vllm_omni_task_type_spellings_and_speaker():
    pcm = {"input": "hi", "response_format": "pcm"}
    async with serve_http(build_gateway(CUSTOM, frames=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        for extra in (
            {"task_type": "CustomVoice", "speaker": "Vivian"},
            {"speaker": "ryan", "voice": "Ryan"},
        ):
            r = await c.post("/v1/audio/speech", json={**pcm, **extra})
            assert r.status_code == 200, r.text
        assert [(j.task, j.voice) for j in gw.talker.jobs] == [
            ("custom_voice", "vivian"),
            ("custom_voice", "ryan"),
        ]
        r = await c.post("/v1/audio/speech", json={**pcm, "voice": "vivian", "speaker": "ryan"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speaker"
        r = await c.post("/v1/audio/speech", json={**pcm, "task_type": "Base", "voice": "vivian"})
        assert r.status_code == 400 and "not served" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "task_type"
    async with serve_http(build_gateway(DESIGN, frames=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json={**pcm, "task_type": "VoiceDesign", "instructions": "calm"})
        assert r.status_code == 200 and gw.talker.jobs[0].task == "voice_design"
    async with serve_http(build_gateway(BASE, frames=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body(task_type="Base"))
        assert r.status_code == 200 and gw.talker.jobs[0].task == "voice_clone"
        r = await c.post("/v1/audio/speech", json=body(task_type="Clone"))
        assert r.status_code == 400 and "Base, CustomVoice, VoiceDesign" in r.json()["error"]["message"]


async def test_every_vllm_omni_field_is_accepted_with_its_meaning():
    from services.gateway.talker_client import generate_request

    omni = body(
        task_type="Base",
        language="en",
        seed=-1,
        max_new_tokens=8,
        sample_rate=16000,
        initial_codec_chunk_frames=3,
        non_streaming_mode=True,
        extra_params={"anything": [1]},
        speaker_embedding=[0.5, -1, 2.0],
    )
    async with serve_http(build_gateway(BASE, frames=2)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=omni)
        assert r.status_code == 200, r.text
        job = gw.talker.jobs[0]
        assert (job.language, job.max_new_frames, job.sample_rate) == ("english", 8, 16000)
        assert job.sampling.seed == 2**63 - 1 and job.x_vector_only
        assert job.first_chunk_frames == 3 and job.streaming_text is False
        req = generate_request(job)
        assert (
            req.streaming.first_chunk_frames == 3
            and req.HasField("streaming_text")
            and not req.streaming_text
        )
        r = await c.post(
            "/v1/audio/speech",
            json=body(
                language="zh-CN",
                non_streaming_mode=False,
                speaker_embedding=[[0.1, 0.2], [0.3, 0.4]],
                extra_params=None,
                initial_codec_chunk_frames=0,
            ),
        )
        assert r.status_code == 200, r.text
        job = gw.talker.jobs[1]
        assert (job.language, job.streaming_text, job.first_chunk_frames) == ("chinese", True, 0)
        r = await c.post("/v1/audio/speech", json=body())
        assert r.status_code == 200 and not generate_request(gw.talker.jobs[2]).HasField("streaming_text")
        for bad, param in (
            ({"language": "de"}, "language"),
            ({"non_streaming_mode": "yes"}, "non_streaming_mode"),
            ({"extra_params": [1]}, "extra_params"),
            ({"speaker_embedding": [1, "x"]}, "speaker_embedding"),
            ({"initial_codec_chunk_frames": -1}, "initial_codec_chunk_frames"),
            ({"ambient_noise": 1}, "ambient_noise"),
        ):
            r = await c.post("/v1/audio/speech", json=body(**bad))
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        assert len(gw.talker.jobs) == 3


async def test_talker_error_before_audio_keeps_its_status():
    gw0 = build_gateway(error_before=NotFound("voice 'bob' does not exist"))
    async with serve_http(gw0) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json={"input": "hi", "voice": "bob", "stream": True})
        assert r.status_code == 404 and r.json()["error"]["message"] == "voice 'bob' does not exist"
        assert gw.synth.admission.active == 0


async def test_admission_rejects_beyond_max_streams():
    gw0 = build_gateway(max_streams=1, frames=200, chunk=1, delay_s=0.05)
    async with serve_http(gw0) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        async with c.stream("POST", "/v1/audio/speech", json=body(stream=True, max_new_tokens=100)) as r1:
            assert r1.status_code == 200
            r2 = await c.post("/v1/audio/speech", json=body())
            assert r2.status_code == 429 and r2.json()["error"]["type"] == "rate_limit_error"
        for _ in range(100):
            if gw.synth.admission.active == 0:
                break
            await asyncio.sleep(0.02)
        assert (await c.post("/v1/audio/speech", json=body(max_new_tokens=2))).status_code == 200


async def test_client_disconnect_cancels_the_talker_call():
    gw0 = build_gateway(frames=1000, chunk=1, delay_s=0.05)
    async with serve_http(gw0) as gw:
        for stream in (True, False):
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
                req = c.build_request(
                    "POST", "/v1/audio/speech", json=body(stream=stream, max_new_tokens=100)
                )
                task = asyncio.create_task(c.send(req, stream=True))
                for _ in range(200):
                    if gw.talker.active:
                        break
                    await asyncio.sleep(0.01)
                assert gw.talker.active == 1
                if stream:
                    r = await task
                    await r.aiter_raw().__anext__()
                    await r.aclose()
                else:
                    task.cancel()
            for _ in range(200):
                if gw.talker.active == 0 and gw.synth.admission.active == 0:
                    break
                await asyncio.sleep(0.02)
            assert gw.talker.active == 0 and gw.synth.admission.active == 0
        assert gw.talker.completed == 0 and gw.talker.closed == 2
        assert gw.metrics.requests_total.labels("http", "cancelled")._value.get() == 2


async def test_models_health_and_voices():
    async with serve_http(build_gateway(CUSTOM)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "tiny-custom"
        assert (await c.get("/health")).status_code == 200
        r = await c.post(
            "/v1/audio/voices",
            files={"audio": ("a.wav", wav_bytes(), "audio/wav")},
            data={"name": "alice", "ref_text": "hello"},
        )
        assert r.status_code == 201 and r.json()["name"] == "alice" and r.json()["ref_text"] == "hello"
        r = await c.post("/v1/audio/voices", json={"name": "bob", "audio": REF, "x_vector_only_mode": True})
        assert r.status_code == 201
        assert (
            await c.post("/v1/audio/voices", json={"name": "bob", "audio": REF, "ref_text": "x"})
        ).status_code == 409
        r = await c.post("/v1/audio/voices", json={"name": "carl", "audio": REF, "x_vector_only_mode": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ref_text"
        # No transcript and no mode: an x-vector-only voice, as OpenAI's upload (no transcript) needs.
        r = await c.post("/v1/audio/voices", json={"name": "carl", "audio": REF})
        assert r.status_code == 201 and r.json()["x_vector_only_mode"] and r.json()["ref_text"] == ""
        r = await c.post(
            "/v1/audio/voices", files={"audio": ("a.wav", wav_bytes(), "audio/wav")}, data={"name": "cleo"}
        )
        assert r.status_code == 201 and r.json()["x_vector_only_mode"], r.text
        r = await c.post("/v1/audio/voices", json={"name": "bad name!", "audio": REF, "ref_text": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name"
        r = await c.post(
            "/v1/audio/voices",
            json={"name": "dan", "audio": base64.b64encode(b"junk").decode(), "ref_text": "x"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
        voices = (await c.get("/v1/audio/voices")).json()["voices"]
        assert [(v["name"], v["kind"]) for v in voices] == [
            ("alice", "cloned"),
            ("bob", "cloned"),
            ("carl", "cloned"),
            ("cleo", "cloned"),
            ("vivian", "preset"),
            ("ryan", "preset"),
        ]
        assert [(v["id"], v["object"], v["type"]) for v in voices[:1]] == [
            ("alice", "audio.voice", "audio_sample")
        ]
        r = await c.get("/v1/audio/voices/alice")
        assert r.status_code == 200 and (r.json()["id"], r.json()["ref_text"]) == ("alice", "hello")
        assert r.json()["duration_s"] == 1.0  # the fake decoder's clip: 24000 samples at 24 kHz
        assert (await c.get("/v1/audio/voices/Vivian")).json()["kind"] == "preset"
        assert (await c.get("/v1/audio/voices/nobody")).status_code == 404
        r = await c.delete("/v1/audio/voices/alice")
        assert r.status_code == 200 and r.json() == {
            "id": "alice",
            "object": "audio.voice.deleted",
            "deleted": True,
            "name": "alice",
        }
        r = await c.delete("/v1/audio/voices/alice")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await c.post(
            "/v1/audio/speech", json={"input": "hi", "voice": "nobody", "response_format": "pcm"}
        )
        assert r.status_code == 404


async def test_voice_upload_with_openai_field_names():
    async with serve_http(build_gateway(BASE)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post(
            "/v1/audio/voice_consents",
            files={"recording": ("c.wav", wav_bytes(), "audio/wav")},
            data={"name": "Erin", "language": "en-US"},
        )
        assert r.status_code == 200, r.text
        consent = r.json()["id"]
        r = await c.post(
            "/v1/audio/voices",
            files={"audio_sample": ("a.wav", wav_bytes(), "audio/wav")},
            data={"name": "erin", "consent": consent, "type": "audio_sample", "ref_text": "hi"},
        )
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "erin" and r.json()["ref_text"] == "hi"
        r = await c.post(
            "/v1/audio/voices",
            json={"name": "fay", "audio_sample": REF, "consent": consent, "x_vector_only_mode": True},
        )
        assert r.status_code == 201, r.text
        assert sorted(gw.voices.voices) == ["erin", "fay"]
        cases = [
            (
                {
                    "files": {"audio_sample": ("a.wav", b"junk", "audio/wav")},
                    "data": {"name": "g", "ref_text": "x"},
                },
                "audio_sample",
            ),
            (
                {
                    "files": {"audio_sample": ("a.wav", wav_bytes(), "audio/wav")},
                    "data": {"name": "g", "ref_text": "x", "type": "prompt"},
                },
                "type",
            ),
            (
                {
                    "data": {"name": "g", "ref_text": "x"},
                    "files": {"other": ("a.wav", wav_bytes(), "audio/wav")},
                },
                "audio_sample",
            ),
            ({"json": {"name": "g", "audio_sample": REF, "ref_text": "x", "consent": 5}}, "consent"),
        ]
        for kw, param in cases:
            r = await c.post("/v1/audio/voices", **kw)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (kw, r.text)
        assert sorted(gw.voices.voices) == ["erin", "fay"]


async def test_health_is_503_when_a_stage_is_not_serving():
    stages = {"talker": "NOT_SERVING", "speaker_cache": "SERVING"}
    async with serve_http(build_gateway(BASE), stages) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.get("/health")
        assert r.status_code == 503 and r.json()["stages"] == stages
