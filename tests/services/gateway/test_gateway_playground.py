"""The playground's server side: GET / and its static files, and the GET /v1/status JSON."""

from __future__ import annotations

import re

import httpx
from gateway_fakes import BASE, build_gateway, free_port, serve_http
from prometheus_client import CollectorRegistry, start_http_server

from qtts.serving.metrics import TalkerMetrics
from services.gateway.http_app import STATIC_DIR
from services.gateway.status import StatusReporter


async def test_root_serves_the_page_and_every_file_it_references():
    async with serve_http(build_gateway(BASE)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        r = await c.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        refs = re.findall(r'(?:src|href)="(/static/[^"]+)"', r.text)
        assert {"/static/playground.js", "/static/playground.css"} <= set(refs)
        for ref in refs:
            assert (await c.get(ref)).status_code == 200, ref
        assert (await c.get("/static/missing.js")).status_code == 404


def test_the_page_fetches_nothing_from_outside_the_gateway():
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"(?:src|href)=\"(?:https?:)?//", text), path
        assert not re.search(r"\b(?:fetch|import)\(\s*[\"'`]https?://", text), path


async def test_status_without_talker_metrics_has_the_model_and_gateway_figures():
    async with serve_http(build_gateway(BASE, max_streams=3)) as gw, httpx.AsyncClient(base_url=gw.url) as c:
        s = (await c.get("/v1/status")).json()
    assert s["ready"] is True and s["talker"] is None
    assert s["model"] == {
        "id": "tiny-base",
        "model_type": "base",
        "model_size": "",
        "languages": ["english", "chinese"],
        "sample_rate": 24000,
    }
    assert s["gateway"]["active_streams"] == 0 and s["gateway"]["max_streams"] == 3


async def test_status_reads_queue_and_step_time_from_the_talker_metrics():
    registry = CollectorRegistry()
    talker = TalkerMetrics(registry)
    talker.queue_depth.set(3)
    talker.active_streams.set(5)
    talker.step_seconds.observe(0.010)
    talker.step_seconds.observe(0.030)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        gw = build_gateway(BASE)
        s = await StatusReporter(gw.synth, f"http://127.0.0.1:{port}/metrics").snapshot()
    finally:
        server.shutdown()
        thread.join(5)
    t = s["talker"]
    assert (t["queue_depth"], t["active_streams"], t["step_seconds_count"]) == (3, 5, 2)
    assert abs(t["step_seconds_sum"] - 0.040) < 1e-9


async def test_status_says_when_the_talker_metrics_are_unreachable():
    gw = build_gateway(BASE)
    s = await StatusReporter(gw.synth, f"http://127.0.0.1:{free_port()}/metrics").snapshot()
    assert s["talker"] == {"error": "talker metrics unreachable"}
