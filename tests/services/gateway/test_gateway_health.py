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
