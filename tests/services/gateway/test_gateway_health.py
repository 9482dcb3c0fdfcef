"""Health that tells the truth: liveness is the process; readiness needs the talker but not
speaker_cache (voices only); the gateway's gRPC health follows the talker's."""

from __future__ import annotations

import asyncio

import grpc
import httpx
from gateway_fakes import BASE, build_gateway, fake_decode, free_port, serve_http
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_gateway_server import FakeTalkerServicer, _start_talker

from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer


async def test_readiness_survives_a_speaker_cache_outage_but_not_a_talker_one():
    down = {"talker": "SERVING", "speaker_cache": "UNREACHABLE (UNAVAILABLE)"}
    async with serve_http(build_gateway(BASE), down) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        for path in ("/health", "/readyz"):
            r = await c.get(path)
            assert r.status_code == 200 and r.json()["status"] == "degraded" and r.json()["stages"] == down
        assert (await c.get("/livez")).json() == {"status": "ok"}
    no_talker = {"talker": "NOT_SERVING", "speaker_cache": "SERVING"}
    async with serve_http(build_gateway(BASE), no_talker) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get("/livez")).status_code == 200


async def _status(stub) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)).status


async def _eventually(stub, status: int, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while await _status(stub) != status:
        assert asyncio.get_running_loop().time() < deadline, f"health never became {status}"
        await asyncio.sleep(0.05)


async def test_grpc_health_follows_the_talker():
    talker_host = await _start_talker(FakeTalkerServicer())
    config = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{talker_host.bound_port}",
        speaker_cache=f"127.0.0.1:{free_port()}",
        talker_refresh_s=0.1,
        drain_seconds=0.5,
    ).validate()
    gateway = GatewayServer(config, catalog_retry_s=0.05, decode=fake_decode)
    await gateway.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            serving, not_serving = (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
            await _eventually(stub, serving)  # speaker_cache unreachable: still SERVING
            await talker_host.set_not_serving()
            await _eventually(stub, not_serving)
            await talker_host.set_serving()
            await _eventually(stub, serving)
    finally:
        await gateway.stop()
        await talker_host.stop(0)


async def test_readiness_is_what_a_new_stream_would_find():
    """Readiness and POST /v1/audio/speech agree: with the talker pool, /readyz reports the pool's
    view of its talkers, the one a new stream is placed from. Here the talker itself is SERVING
    (a health check over another channel says so) while the pool's probe of it fails, as when the
    pool's channel still waits out its reconnect backoff after a talker restart: before, /readyz
    said 200 while the speech endpoint answered 503."""
    talker_host = await _start_talker(FakeTalkerServicer())
    config = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{talker_host.bound_port}",
        speaker_cache=f"127.0.0.1:{free_port()}",
        talker_refresh_s=30.0,  # no background refresh during the test: readiness probes by itself
        drain_seconds=0.5,
    ).validate()
    gateway = GatewayServer(config, catalog_retry_s=0.05, decode=fake_decode)
    pool = gateway.talker_pool
    real_probe, pool_sees_talker = pool._probe, [True]

    async def probe(channel) -> bool | None:
        return await real_probe(channel) if pool_sees_talker[0] else False

    pool._probe = probe
    body = {"input": "Hi.", "voice": "alice", "max_new_tokens": 2, "response_format": "pcm"}
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.http_port}", timeout=10) as c:
            for _ in range(200):
                if (await c.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            for sees in (True, False, True, False, True):
                pool_sees_talker[0] = sees
                ready = await c.get("/readyz")
                speech = await c.post("/v1/audio/speech", json=body)
                assert ready.status_code == (200 if sees else 503), ready.text
                assert ready.json()["stages"]["talker"] == ("SERVING" if sees else "NOT_SERVING")
                # The talker is up all along; only what the pool can reach decides both answers.
                assert speech.status_code == ready.status_code, speech.text[:200]
    finally:
        await gateway.stop()
        await talker_host.stop(0)
