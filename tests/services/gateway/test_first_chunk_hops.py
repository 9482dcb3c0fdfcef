"""The gateway's first-chunk hop histogram: where a request's first audio went at the gateway."""

from __future__ import annotations

import httpx
from gateway_fakes import build_gateway, clone_body, serve_http

HOPS = ("admit", "talker", "to_client")


def hop(gw, name: str, kind: str = "count") -> float:
    return (
        gw.metrics.registry.get_sample_value(f"tts_gateway_first_chunk_hop_seconds_{kind}", {"hop": name})
        or 0.0
    )


def ttfa(gw, kind: str = "count") -> float:
    return gw.metrics.registry.get_sample_value(f"tts_gateway_ttfa_seconds_{kind}") or 0.0


async def test_each_first_chunk_hop_is_observed_once_and_they_add_up_to_first_audio():
    """The fake talker sleeps 50 ms before its first chunk: that time is the talker hop's, and the
    three hops together are the request's time to first audio."""
    async with (
        serve_http(build_gateway(frames=4, chunk=2, delay_s=0.05)) as gw,
        httpx.AsyncClient(base_url=gw.url) as client,
    ):
        for streamed in (True, False):
            r = await client.post("/v1/audio/speech", json=clone_body(stream=streamed))
            assert r.status_code == 200 and r.content
        assert [hop(gw, name) for name in HOPS] == [2, 2, 2]
        assert ttfa(gw) == 2
        assert hop(gw, "talker", "sum") >= 2 * 0.05
        assert sum(hop(gw, name, "sum") for name in HOPS) <= ttfa(gw, "sum")


async def test_a_request_without_audio_records_no_first_chunk_hops():
    async with serve_http(build_gateway(frames=0)) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/audio/speech", json=clone_body(stream=True))
        assert r.status_code == 200
        assert [hop(gw, name) for name in HOPS] == [0, 0, 0]


def refusal_hop(gw, name: str) -> float:
    return gw.metrics.registry.get_sample_value("tts_gateway_refusal_hop_seconds_count", {"hop": name}) or 0.0


async def test_a_talker_refusal_records_where_its_time_went():
    """A request the talker refuses is a 429 with its admit and talker hops observed once each, and
    no first-chunk hops; a request the gateway refuses before any talker call records neither."""
    from qtts.request.errors import ResourceExhausted

    gw = build_gateway(frames=4, chunk=2, error_before=ResourceExhausted("the talker is at capacity", 2))
    async with serve_http(gw) as gw, httpx.AsyncClient(base_url=gw.url) as client:
        r = await client.post("/v1/audio/speech", json=clone_body(stream=True))
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert [refusal_hop(gw, name) for name in ("admit", "talker")] == [1, 1]
        assert [hop(gw, name) for name in HOPS] == [0, 0, 0]
        r = await client.post("/v1/audio/speech", json={**clone_body(stream=True), "speed": 99})
        assert r.status_code == 400
        assert [refusal_hop(gw, name) for name in ("admit", "talker")] == [1, 1]
