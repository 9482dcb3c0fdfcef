"""Error messages that reach the public name no internal address or Redis command."""

from __future__ import annotations

import base64

import grpc
import httpx
import pytest
from gateway_fakes import build_gateway, serve_http, wav_bytes

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.request.errors import Unavailable, redact_internal
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.launcher import free_port
from services.speaker_cache.redis_store import RedisStore

LEAKY = Unavailable(
    "talker at 10.1.2.3:50052: failed to connect; last error: ipv4:10.1.2.3:50052: refused; "
    "code2wav replica c2w-0.code2wav.tts.svc.cluster.local:50053 went away; redis://:secret@redis:6379/0"
)


def test_redaction_keeps_ordinary_messages():
    assert redact_internal("temperature must be in 0..10.0, got 3.5e+38") == (
        "temperature must be in 0..10.0, got 3.5e+38"
    )
    assert "10.1.2.3" not in redact_internal(LEAKY.message) and "secret" not in redact_internal(LEAKY.message)


async def test_http_and_grpc_errors_name_no_internal_address():
    gw = build_gateway(error_before=LEAKY)
    ref = base64.b64encode(wav_bytes(0.2)).decode()
    body = {
        "input": "Hi.",
        "ref_audio": ref,
        "x_vector_only_mode": True,
        "response_format": "pcm",
        "stream": False,
    }
    async with serve_http(gw) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.post("/v1/audio/speech", json=body)
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "<internal>" in message and not any(
            s in message for s in ("10.1.2.3", "svc.cluster", "secret")
        )
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor(gw.metrics, redact=True)])
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(gw.synth, gw.voice_service), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
            req = tts_pb2.SynthesizeRequest(text="Hi.", reference_audio=wav_bytes(0.2), x_vector_only=True)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Synthesize(req):
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "10.1.2.3" not in info.value.details() and "svc.cluster" not in info.value.details()
    finally:
        await server.stop(0)


async def test_a_redis_outage_message_names_no_address():
    port = free_port()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    try:
        with pytest.raises(Unavailable) as info:
            await store.list_voices()
        assert str(port) not in info.value.message and "127.0.0.1" not in info.value.message
    finally:
        await store.close()
