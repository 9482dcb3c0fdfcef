"""The gateway's per-route HTTP metrics: route templates (not raw paths), method, status, time to
the last byte of a streamed body."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry

from qtts.serving.metrics import GatewayMetrics
from services.gateway.http_metrics import HttpMetricsMiddleware


def app_with_metrics() -> tuple[FastAPI, GatewayMetrics]:
    metrics = GatewayMetrics(CollectorRegistry())
    app = FastAPI()

    @app.get("/v1/audio/voices/{name}")
    async def voice(name: str):
        return {"id": name}

    @app.post("/v1/audio/speech")
    async def speech():
        async def body():
            for _ in range(3):
                await asyncio.sleep(0.05)
                yield b"\0\0"

        return StreamingResponse(body(), media_type="audio/pcm")

    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    return app, metrics


def value(metrics: GatewayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_requests_are_counted_by_route_template_method_and_status():
    app, metrics = app_with_metrics()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        for name in ("alice", "bob"):
            assert (await client.get(f"/v1/audio/voices/{name}")).status_code == 200
        assert (await client.get("/nope/123")).status_code == 404
        assert (await client.post("/v1/audio/speech")).content == b"\0\0" * 3
    route = "/v1/audio/voices/{name}"
    assert value(metrics, "tts_http_requests_total", route=route, method="GET", status="200") == 2
    assert value(metrics, "tts_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert (
        value(metrics, "tts_http_requests_total", route="/v1/audio/speech", method="POST", status="200") == 1
    )
    # The streamed response is timed to its last chunk (3 x 50 ms).
    assert (
        value(metrics, "tts_http_request_duration_seconds_sum", route="/v1/audio/speech", method="POST")
        >= 0.14
    )
