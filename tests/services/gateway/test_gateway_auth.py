"""Optional API keys: refused without a valid key on HTTP, WebSocket and gRPC; voices owned per key."""

from __future__ import annotations

import asyncio
import base64
import contextlib

import grpc
import httpx
import pytest
import uvicorn
from gateway_fakes import build_gateway, free_port, serve_http, wav_bytes
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.auth import ApiKeyInterceptor, ApiKeys, load_api_keys
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.server import _UvicornServer

KEYS = ApiKeys(["key-a", "key-b"])
A, B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
CLIP = wav_bytes(0.3)
SPEECH = {"model": "tiny-base", "input": "Hello.", "response_format": "pcm", "stream": False}


def test_keys_from_a_file_and_the_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# gateway keys\nk1\n\n  k2  \n")
    assert load_api_keys(str(path), "k3, k4,") == {"k1", "k2", "k3", "k4"}
    assert load_api_keys("", "") == frozenset()
    assert KEYS.owner("key-a") and KEYS.owner("key-a") != KEYS.owner("key-b")
    assert KEYS.owner("key-") is None and KEYS.owner("") is None


@contextlib.asynccontextmanager
async def keyed_http(gw):
    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, api_keys=KEYS))
    port = free_port()
    server = _UvicornServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


async def test_http_needs_a_valid_key_and_voices_belong_to_their_key():
    gw = build_gateway(frames=2)
    async with keyed_http(gw) as (url, _), httpx.AsyncClient(base_url=url) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic a2V5LWE="}):
            r = await c.get("/v1/audio/voices", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert (await c.get("/health")).status_code == 200  # probes stay open
        assert (await c.get("/")).status_code == 200  # the playground asks for the key itself
        files = {"audio_sample": ("a.wav", CLIP, "audio/wav")}
        r = await c.post("/v1/audio/voices", data={"name": "mine"}, files=files, headers=A)
        assert r.status_code == 201 and r.json()["name"] == "mine"
        assert [v["name"] for v in (await c.get("/v1/audio/voices", headers=A)).json()["voices"]] == ["mine"]
        assert (await c.get("/v1/audio/voices", headers=B)).json()["voices"] == []
        assert (await c.get("/v1/audio/voices/mine", headers=B)).status_code == 404
        assert (await c.delete("/v1/audio/voices/mine", headers=B)).status_code == 404
        # B may have a voice of the same name: a different stored voice.
        r = await c.post("/v1/audio/voices", data={"name": "mine"}, files=files, headers=B)
        assert r.status_code == 201
        assert sorted(gw.voices.voices) == sorted(f"{KEYS.owner(k)}.mine" for k in ("key-a", "key-b"))
        r = await c.post("/v1/audio/speech", json={**SPEECH, "voice": "mine"}, headers=A)
        assert r.status_code == 200 and gw.talker.jobs[-1].voice == f"{KEYS.owner('key-a')}.mine"
        assert (await c.delete("/v1/audio/voices/mine", headers=A)).status_code == 200
        assert [v["name"] for v in (await c.get("/v1/audio/voices", headers=B)).json()["voices"]] == ["mine"]


def test_websocket_key_as_a_query_parameter():
    gw = build_gateway(frames=2)

    async def stage_health():
        return {}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, api_keys=KEYS))
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect):
            with client.websocket_connect("/v1/audio/speech/stream") as ws:
                ws.receive_text()
        with client.websocket_connect("/v1/audio/speech/stream?api_key=key-a") as ws:
            ws.send_json(
                {
                    "type": "session.config",
                    "ref_audio": base64.b64encode(CLIP).decode(),
                    "x_vector_only_mode": True,
                }
            )
            ws.close()


async def test_grpc_needs_a_valid_key():
    gw = build_gateway(frames=2)
    server = grpc.aio.server(
        interceptors=[
            ErrorMappingInterceptor(gw.metrics),
            ApiKeyInterceptor(KEYS, ["tts.v1.TextToSpeechService"]),
        ]
    )
    servicer = TextToSpeechServicer(gw.synth, gw.voice_service, KEYS)
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
            req = tts_pb2.SynthesizeRequest(text="Hi.", reference_audio=CLIP, x_vector_only=True)
            for metadata in ((), (("authorization", "Bearer nope"),)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Synthesize(req, metadata=metadata):
                        pass
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListVoices(tts_pb2.ListVoicesRequest(), metadata=metadata)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = [m async for m in stub.Synthesize(req, metadata=(("authorization", "Bearer key-a"),))]
            assert ok[-1].HasField("summary")
            await stub.CreateVoice(
                tts_pb2.CreateVoiceRequest(name="g", reference_audio=CLIP),
                metadata=(("authorization", "Bearer key-a"),),
            )
            theirs = await stub.ListVoices(
                tts_pb2.ListVoicesRequest(), metadata=(("authorization", "Bearer key-b"),)
            )
            assert [v.name for v in theirs.voices if v.kind != "preset"] == []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.DeleteVoice(
                    tts_pb2.DeleteVoiceRequest(name="g"), metadata=(("authorization", "Bearer key-b"),)
                )
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(0)


async def test_no_keys_no_authentication():
    async with serve_http(build_gateway()) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        assert (await c.get("/v1/audio/voices")).status_code == 200
