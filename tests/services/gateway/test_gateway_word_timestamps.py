"""HTTP word_timestamps: refused without an aligner (400 naming the field); with a real aligner
server (the tiny random aligner) a JSON answer or an SSE event with vLLM-Omni's word shape."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from gateway_fakes import FRAME, ModelCatalog, build_gateway, frame_pcm, serve_http
from websockets.asyncio.client import connect

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.aligner.config import AlignerConfig
from services.aligner.server import AlignerServer
from services.gateway.aligner_client import FLOAT32_RETRY_S, AlignerClient
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.launcher import free_port

TEXT = "Hello there, my friend."


def body(**kw) -> dict:
    return {"model": "tiny-base", "input": TEXT, "voice": "vivian", "response_format": "wav", **kw}


@pytest.fixture
async def aligner_client(tiny_aligner):
    server = AlignerServer(AlignerConfig(port=0, metrics_port=0), aligner=tiny_aligner)
    port = await server.start()
    client = AlignerClient(f"127.0.0.1:{port}")
    try:
        yield client
    finally:
        await client.close()
        await server.stop(grace=0.5)


def _expected(tiny_aligner, frames: int, speed: float = 1.0) -> list[dict]:
    pcm = np.frombuffer(frame_pcm(0, frames), "<i2").astype(np.float32) / 32768.0
    words = tiny_aligner.align(pcm, 24000, TEXT, "english")
    return [
        {"word": w.word, "start_ms": round(w.start_s * 1000 / speed), "end_ms": round(w.end_s * 1000 / speed)}
        for w in words
    ]


@pytest.mark.parametrize("extra", [{}, {"stream": False}, {"stream_format": "sse"}])
async def test_without_an_aligner_word_timestamps_is_a_400_naming_it(extra):
    async with serve_http(build_gateway(frames=4)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body(word_timestamps=True, **extra))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "word_timestamps" and "forced aligner" in err["message"]
        assert gw.talker.jobs == []  # refused before any synthesis
        # false is the default and always fine
        r = await c.post("/v1/audio/speech", json=body(word_timestamps=False, stream=False))
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"


async def test_whole_file_json_with_the_aligners_words(aligner_client, tiny_aligner):
    async with (
        serve_http(build_gateway(frames=25, chunk=5), aligner=aligner_client) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as c,
    ):
        plain = await c.post("/v1/audio/speech", json=body(stream=False))
        r = await c.post("/v1/audio/speech", json=body(word_timestamps=True))
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        out = r.json()
        assert base64.b64decode(out["audio"]) == plain.content  # the same whole wav file
        assert (out["response_format"], out["sample_rate"], out["finish_reason"]) == ("wav", 24000, "length")
        assert [w["word"] for w in out["timestamps"]] == ["Hello", "there", "my", "friend"]
        assert out["timestamps"] == _expected(tiny_aligner, 25)
        assert out["usage"]["output_tokens"] == 25
        # speed stretches the audio, and the timestamps with it
        fast = (await c.post("/v1/audio/speech", json=body(word_timestamps=True, speed=2.0))).json()
        assert fast["timestamps"] == _expected(tiny_aligner, 25, speed=2.0)
        assert fast["timestamps"] != out["timestamps"]


async def test_sse_sends_a_timestamps_event_after_the_audio(aligner_client, tiny_aligner):
    async with (
        serve_http(build_gateway(frames=20, chunk=5), aligner=aligner_client) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as c,
    ):
        r = await c.post(
            "/v1/audio/speech", json=body(word_timestamps=True, stream_format="sse", response_format="pcm")
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["speech.audio.timestamps", "speech.audio.done"]
        assert set(kinds[:-2]) == {"speech.audio.delta"}
        audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-2])
        assert audio == frame_pcm(0, 20) and len(audio) == 20 * FRAME * 2
        assert events[-2]["timestamps"] == _expected(tiny_aligner, 20)
        assert events[-2]["request_id"] == events[-1]["request_id"]


async def test_korean_is_refused_up_front(aligner_client):
    korean = ModelCatalog(name="tiny-base", model_type="base", languages=("english", "korean"))
    async with (
        serve_http(build_gateway(korean, frames=4), aligner=aligner_client) as gw,
        httpx.AsyncClient(base_url=gw.url) as c,
    ):
        r = await c.post("/v1/audio/speech", json=body(word_timestamps=True, language="korean"))
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "word_timestamps" and "korean" in r.json()["error"]["message"]


async def test_an_unreachable_aligner_leaves_timestamps_null_and_the_audio_whole():
    client = AlignerClient(f"127.0.0.1:{free_port()}", timeout_s=2.0)
    try:
        async with (
            serve_http(build_gateway(frames=5), aligner=client) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=30) as c,
        ):
            plain = await c.post("/v1/audio/speech", json=body(stream=False))
            out = (await c.post("/v1/audio/speech", json=body(word_timestamps=True))).json()
            assert out["timestamps"] is None
            assert base64.b64decode(out["audio"]) == plain.content
    finally:
        await client.close()


def _ws_url(gw) -> str:
    return gw.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


async def _recv_segment(ws) -> tuple[dict, bytes, dict]:
    start = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert start["type"] == "audio.start", start
    audio = b""
    while isinstance(msg := await asyncio.wait_for(ws.recv(), 10), bytes):
        audio += msg
    return start, audio, json.loads(msg)


async def test_websocket_sentence_segments_each_carry_their_words_after_their_audio(
    aligner_client, tiny_aligner
):
    config = {
        "type": "session.config",
        "voice": "vivian",
        "response_format": "pcm",
        "stream_audio": True,
        "split_granularity": "sentence",
        "word_timestamps": True,
    }
    frames = 10
    seconds = frames * FRAME / 24000
    async with (
        serve_http(build_gateway(frames=frames, chunk=5), aligner=aligner_client) as gw,
        connect(_ws_url(gw)) as ws,
    ):
        await ws.send(json.dumps(config))
        for piece in ["Hello there. ", "How are ", "you today? "]:
            await ws.send(json.dumps({"type": "input.text", "text": piece}))
        await ws.send(json.dumps({"type": "input.done"}))
        segs = [await _recv_segment(ws) for _ in range(2)]
        end = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert end["type"] == "session.done" and end["total_sentences"] == 2
    pcm = np.frombuffer(frame_pcm(0, frames), "<i2").astype(np.float32) / 32768.0
    for k, (_, audio, done) in enumerate(segs):
        assert audio == frame_pcm(0, frames)
        words = tiny_aligner.align(pcm, 24000, done["sentence_text"], "english")
        assert done["timestamps"] == [
            {
                "word": w.word,
                "start_ms": round((w.start_s + k * seconds) * 1000),
                "end_ms": round((w.end_s + k * seconds) * 1000),
            }
            for w in words
        ]
    assert [w["word"] for _, _, d in segs for w in d["timestamps"]] == [
        "Hello",
        "there",
        "How",
        "are",
        "you",
        "today",
    ]


async def test_websocket_without_an_aligner_refuses_word_timestamps():
    async with serve_http(build_gateway(frames=2)) as gw, connect(_ws_url(gw)) as ws:
        await ws.send(json.dumps({"type": "session.config", "voice": "vivian", "word_timestamps": True}))
        err = json.loads(await asyncio.wait_for(ws.recv(), 5))
        assert (err["type"], err["param"], err["code"]) == ("error", "word_timestamps", "invalid_value")
        assert "forced aligner" in err["message"]


@contextlib.asynccontextmanager
async def _serve_grpc(gw, aligner):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)])
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(gw.synth, gw.voice_service, aligner=aligner), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield tts_pb2_grpc.TextToSpeechServiceStub(channel)
    await server.stop(0)


def _pb_words(summary) -> list[dict]:
    return [{"word": w.word, "start_ms": w.start_ms, "end_ms": w.end_ms} for w in summary.word_timestamps]


async def test_grpc_synthesize_summary_carries_the_words(aligner_client, tiny_aligner):
    gw = build_gateway(frames=15, chunk=5)
    req = tts_pb2.SynthesizeRequest(text=TEXT, voice="vivian", word_timestamps=True)
    async with _serve_grpc(gw, aligner_client) as stub:
        msgs = [m async for m in stub.Synthesize(req)]
    summary = msgs[-1].summary
    assert _pb_words(summary) == _expected(tiny_aligner, 15) and not summary.word_timestamps_failed
    assert b"".join(m.audio.audio for m in msgs[:-1]) == frame_pcm(0, 15)


async def test_grpc_without_an_aligner_refuses_word_timestamps():
    gw = build_gateway(frames=2)
    async with _serve_grpc(gw, None) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [
                m
                async for m in stub.Synthesize(
                    tts_pb2.SynthesizeRequest(text=TEXT, voice="vivian", word_timestamps=True)
                )
            ]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "forced aligner" in e.value.details()
    assert gw.talker.jobs == []


async def test_grpc_streaming_each_segment_summary_has_its_words_on_the_calls_clock(
    aligner_client, tiny_aligner
):
    frames = 10
    seconds = frames * FRAME / 24000
    config = tts_pb2.StreamingSynthesizeConfig(
        synthesis=tts_pb2.SynthesizeRequest(voice="vivian", word_timestamps=True),
        text_split=tts_pb2.TEXT_SPLIT_SENTENCE,
    )

    async def requests():
        yield tts_pb2.StreamingSynthesizeRequest(streaming_config=config)
        for piece in ["Hello there. ", "How are you today?"]:
            yield tts_pb2.StreamingSynthesizeRequest(input=tts_pb2.StreamingSynthesisInput(text=piece))

    gw = build_gateway(frames=frames, chunk=5)
    async with _serve_grpc(gw, aligner_client) as stub:
        msgs = [m async for m in stub.StreamingSynthesize(requests())]
    summaries = [m.segment_summary for m in msgs if m.HasField("segment_summary")]
    texts = [m.segment_start.text for m in msgs if m.HasField("segment_start")]
    assert len(summaries) == 2
    pcm = np.frombuffer(frame_pcm(0, frames), "<i2").astype(np.float32) / 32768.0
    for k, (summary, text) in enumerate(zip(summaries, ["Hello there.", "How are you today?"], strict=True)):
        words = tiny_aligner.align(pcm, 24000, text, "english")
        assert _pb_words(summary) == [
            {
                "word": w.word,
                "start_ms": round((w.start_s + k * seconds) * 1000),
                "end_ms": round((w.end_s + k * seconds) * 1000),
            }
            for w in words
        ]
    assert texts[0].startswith("Hello")


def _client_package(tmp_path: Path) -> Path:
    """clients/python/src's package with its stubs built as its setup.py builds them, under
    `tmp_path` (imported in a process of its own: tts.v1 is in this one's descriptor pool)."""
    import shutil

    import grpc_tools
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[3]
    pkg = tmp_path / "qwen3_tts_client"
    shutil.copytree(root / "clients" / "python" / "src" / "qwen3_tts_client", pkg)
    (pkg / "_proto").mkdir()
    shutil.copy(root / "protos" / "tts" / "v1" / "tts.proto", pkg / "_proto" / "tts.proto")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{tmp_path}", f"-I{well_known}", f"--python_out={tmp_path}"]
    assert protoc.main([*args, f"--grpc_python_out={tmp_path}", "qwen3_tts_client/_proto/tts.proto"]) == 0
    (pkg / "_proto" / "__init__.py").touch()
    return tmp_path


CLIENT_SCRIPT = """
import json, sys
import qwen3_tts_client as c
with c.TTSClient(sys.argv[1]) as client:
    audio, s = client.synthesize_bytes(sys.argv[2], c.SynthesisOptions(voice="vivian", word_timestamps=True))
words = [[w.word, w.start_ms, w.end_ms] for w in s.word_timestamps]
print(json.dumps({"bytes": len(audio), "words": words, "failed": s.word_timestamps_failed}))
"""


async def test_python_client_reads_the_words_of_the_summary(aligner_client, tiny_aligner, tmp_path):
    import os
    import sys

    path = _client_package(tmp_path)
    gw = build_gateway(frames=15, chunk=5)
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics)])
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(gw.synth, gw.voice_service, aligner=aligner_client), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENT_SCRIPT,
            f"127.0.0.1:{port}",
            TEXT,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(path)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        await server.stop(0)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["bytes"] == len(frame_pcm(0, 15)) and result["failed"] is False
    assert result["words"] == [[w["word"], w["start_ms"], w["end_ms"]] for w in _expected(tiny_aligner, 15)]


async def test_the_client_sends_16_bit_audio_and_falls_back_to_float32_for_an_older_aligner():
    """The gateway sends the talker's 16-bit PCM as is; an aligner from before `pcm_s16le` reads
    only `pcm_f32` and calls such a request empty: the client sends that request again as float32
    (the same samples scaled by 1/32768), and every later one for a minute, so a rolling update
    loses no timestamps; then 16-bit again, so once the old aligners are gone the audio goes as
    the talker made it."""
    from qtts.pb import aligner_pb2, aligner_pb2_grpc

    seen: list[aligner_pb2.AlignRequest] = []

    class OldAligner(aligner_pb2_grpc.AlignerServiceServicer):
        async def Align(self, request, context):
            seen.append(request)
            if not request.pcm_f32:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "pcm_f32 is empty")
            n = len(request.pcm_f32) // 4
            return aligner_pb2.AlignResponse(
                words=[aligner_pb2.WordTimestamp(word="w", start_s=0.0, end_s=n / 24000)]
            )

    server = grpc.aio.server()
    aligner_pb2_grpc.add_AlignerServiceServicer_to_server(OldAligner(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    now = [0.0]
    client = AlignerClient(f"127.0.0.1:{port}", clock=lambda: now[0])
    pcm = frame_pcm(0, 3)
    try:
        first = await client.align("r1", TEXT, "english", pcm)
        second = await client.align("r2", TEXT, "english", pcm)
        now[0] = FLOAT32_RETRY_S + 1  # still an old aligner a minute later: 16-bit, then float32
        third = await client.align("r3", TEXT, "english", pcm)
    finally:
        await client.close()
        await server.stop(0)
    samples = len(pcm) // 2
    assert first == second == third == [{"word": "w", "start_ms": 0, "end_ms": round(samples / 24000 * 1000)}]
    assert [bool(r.pcm_s16le) for r in seen] == [True, False, False, True, False]
    scaled = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    assert all(np.array_equal(np.frombuffer(r.pcm_f32, "<f4"), scaled) for r in seen if not r.pcm_s16le)
    assert seen[0].pcm_s16le == pcm and not seen[0].pcm_f32
