"""The per-client request rate (services/gateway/rate_limit.py): a token bucket per API key (else
address), a 429 with Retry-After / RESOURCE_EXHAUSTED with pushback beyond it, other clients and
the probes untouched."""

from __future__ import annotations

import asyncio
import base64
import contextlib

import grpc
import httpx
import pytest
import uvicorn
from gateway_fakes import build_gateway, free_port, wav_bytes
from test_gateway_grpc import request as grpc_request

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.request.errors import ResourceExhausted
from qtts.serving.grpc_server import ErrorMappingInterceptor
from services.gateway.grpc_servicer import TextToSpeechServicer
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.rate_limit import RateLimiter, RateLimitInterceptor
from services.gateway.server import SERVICE_NAME, _UvicornServer

GOOD = {
    "model": "tiny-base",
    "input": "Hello there.",
    "ref_audio": base64.b64encode(wav_bytes(0.2)).decode(),
    "x_vector_only_mode": True,
    "response_format": "pcm",
    "stream": False,
    "max_new_tokens": 2,
}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_a_burst_then_the_rate_and_says_when_to_retry():
    clock = Clock()
    limiter = RateLimiter(rate_per_s=2.0, burst=3, clock=clock)
    for _ in range(3):
        limiter.check("key:a")
    with pytest.raises(ResourceExhausted) as info:
        limiter.check("key:a")
    assert info.value.retry_after_s == 1 and "rate limit" in info.value.message
    limiter.check("key:b")  # another client has its own bucket
    clock.now += 0.5  # one token back at 2 a second
    limiter.check("key:a")
    with pytest.raises(ResourceExhausted):
        limiter.check("key:a")
    clock.now += 60  # refilled to the burst, not beyond it
    for _ in range(3):
        limiter.check("key:a")
    with pytest.raises(ResourceExhausted):
        limiter.check("key:a")


def test_retry_after_covers_a_slow_rate():
    limiter = RateLimiter(rate_per_s=0.1, burst=1, clock=Clock())
    limiter.check("addr:1.2.3.4")
    with pytest.raises(ResourceExhausted) as info:
        limiter.check("addr:1.2.3.4")
    assert info.value.retry_after_s == 10


def test_a_flood_of_client_keys_keeps_the_table_bounded():
    clock = Clock()
    limiter = RateLimiter(rate_per_s=1.0, burst=2, max_clients=100, clock=clock)
    limiter.check("key:hog")
    limiter.check("key:hog")
    for i in range(10_000):
        limiter.check(f"addr:10.0.{i // 256}.{i % 256}")
    assert len(limiter) <= 100
    clock.now += 10  # every bucket refilled: forgotten on the next insert past the bound
    for i in range(101):
        limiter.check(f"key:new-{i}")
    assert len(limiter) <= 100


@contextlib.asynccontextmanager
async def serve_http(gw, limiter: RateLimiter):
    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, rate_limiter=limiter))
    port = free_port()
    server = _UvicornServer(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def _from_address(url: str, address: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, timeout=10, transport=httpx.AsyncHTTPTransport(local_address=address)
    )


async def test_http_client_over_its_rate_gets_429_with_retry_after_and_others_go_on():
    gw = build_gateway()
    limiter = RateLimiter(rate_per_s=0.01, burst=3)
    async with serve_http(gw, limiter) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        hog = {"authorization": "Bearer key-a"}
        codes = [(await c.post("/v1/audio/speech", json=GOOD, headers=hog)).status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        refused = await c.post("/v1/audio/speech", json=GOOD, headers=hog)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        hint_ms = 1000 * int(refused.headers["retry-after"])
        assert hint_ms <= int(refused.headers["retry-after-ms"]) < 1.5 * hint_ms
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "rate limit" in error["message"]
        # Bad requests count too: a flood of 400s is a flood.
        assert (await c.post("/v1/audio/voices", json={}, headers=hog)).status_code == 429
        # Without API keys a client is its address, whatever token it sends: another token from
        # the same address is the same client; another address is another.
        fresh = await c.post("/v1/audio/speech", json=GOOD, headers={"authorization": "Bearer key-b"})
        assert fresh.status_code == 429
        async with _from_address(url, "127.0.0.2") as elsewhere:
            other = await elsewhere.post("/v1/audio/speech", json=GOOD, headers=hog)
        assert other.status_code == 200
        # Probes and the playground never count.
        for _ in range(10):
            assert (await c.get("/health", headers=hog)).status_code == 200
            assert (await c.get("/livez", headers=hog)).status_code == 200
    assert len(gw.talker.jobs) == 4


async def test_grpc_client_over_its_rate_gets_resource_exhausted_with_pushback():
    gw = build_gateway()
    limiter = RateLimiter(rate_per_s=0.01, burst=2)
    server = grpc.aio.server(
        # As with API keys on (the key interceptor in front has checked them): a key is a client.
        interceptors=[
            ErrorMappingInterceptor(gw.metrics),
            RateLimitInterceptor(limiter, [SERVICE_NAME], keys_enabled=True),
        ]
    )
    tts_pb2_grpc.add_TextToSpeechServiceServicer_to_server(
        TextToSpeechServicer(gw.synth, gw.voice_service), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
            for _ in range(2):
                msgs = [m async for m in stub.Synthesize(grpc_request(max_new_frames=2))]
                assert msgs[-1].summary.num_frames == 2
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Synthesize(grpc_request(max_new_frames=2)):
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = dict(info.value.trailing_metadata())
            assert int(trailers["retry-after"]) >= 1
            # The pushback and retry-after-ms are the hint spread over [1, 1.5) of it.
            hint_ms = 1000 * int(trailers["retry-after"])
            assert trailers["grpc-retry-pushback-ms"] == trailers["retry-after-ms"]
            assert hint_ms <= int(trailers["retry-after-ms"]) < 1.5 * hint_ms
            with pytest.raises(grpc.aio.AioRpcError) as info:  # unary calls count as well
                await stub.ListVoices(tts_pb2.ListVoicesRequest())
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Another key is another client.
            msgs = [
                m
                async for m in stub.Synthesize(
                    grpc_request(max_new_frames=2), metadata=(("authorization", "Bearer key-b"),)
                )
            ]
            assert msgs[-1].summary.num_frames == 2
    finally:
        await server.stop(0)
    assert len(gw.talker.jobs) == 3


def test_flags_and_env_fallbacks(monkeypatch):
    from services.gateway.config import config_from_args

    base = ["--http-port", "8000", "--grpc-port", "50051"]
    c = config_from_args([*base, "--rate-limit-per-s", "5", "--max-ref-audio-seconds", "20"])
    assert (c.rate_limit_per_s, c.rate_limit_burst_size, c.max_ref_audio_seconds) == (5.0, 10, 20.0)
    monkeypatch.setenv("TTS_GATEWAY_RATE_LIMIT_PER_S", "0.5")
    monkeypatch.setenv("TTS_GATEWAY_RATE_LIMIT_BURST", "3")
    c = config_from_args(base)
    assert (c.rate_limit_per_s, c.rate_limit_burst_size, c.max_ref_audio_seconds) == (0.5, 3, 60.0)
    from qtts.request.errors import InvalidArgument

    # A value that does not parse names the flag and its env variable (one line at start-up).
    with pytest.raises(
        InvalidArgument, match="--rate-limit-per-s must be a number.*TTS_GATEWAY_RATE_LIMIT_PER_S"
    ):
        config_from_args([*base, "--rate-limit-per-s", "lots"])
    with pytest.raises(InvalidArgument, match="max-ref-audio-seconds"):
        config_from_args([*base, "--max-ref-audio-seconds", "0"])


async def test_the_assembled_gateway_limits_rate_over_http_and_grpc_and_clip_length():
    from test_gateway_server import FakeTalkerServicer, _start_talker

    from services.gateway.config import GatewayConfig
    from services.gateway.server import GatewayServer

    talker_host = await _start_talker(FakeTalkerServicer())
    config = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{talker_host.bound_port}",
        speaker_cache=f"127.0.0.1:{free_port()}",
        drain_seconds=1.0,
        rate_limit_per_s=0.01,
        rate_limit_burst=3,
        max_ref_audio_seconds=2.0,
    ).validate()
    gateway = GatewayServer(config, catalog_retry_s=0.05)  # the real reference decoder
    await gateway.start()
    body = {**GOOD, "model": ""}
    try:
        for _ in range(100):
            if gateway.catalog is not None:
                break
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.http_port}", timeout=10) as c:
            assert (await c.post("/v1/audio/speech", json=body)).status_code == 200
            long_clip = {**body, "ref_audio": base64.b64encode(wav_bytes(3.0)).decode()}
            r = await c.post("/v1/audio/speech", json=long_clip)
            assert r.status_code == 400 and r.json()["error"]["param"] == "ref_audio"
            assert "longer than 2 s" in r.json()["error"]["message"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
            # The third request of this client (127.0.0.1), over either protocol, uses up its burst.
            msgs = [m async for m in stub.Synthesize(grpc_request(max_new_frames=2))]
            assert msgs[-1].summary.num_frames == 2
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Synthesize(grpc_request(max_new_frames=2)):
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.http_port}", timeout=10) as c:
            r = await c.post("/v1/audio/speech", json=body)
            assert r.status_code == 429 and r.headers["retry-after"]
            assert (await c.get("/health")).status_code == 200
    finally:
        await gateway.stop()
        await talker_host.stop()
