"""Per-client stream limits (by API key, else address) and the Retry-After of every refusal."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from gateway_fakes import build_gateway, clone_body, serve_http
from test_gateway_grpc import request as grpc_request
from test_gateway_grpc import serve_grpc

from qtts.request.errors import ResourceExhausted
from services.gateway.client_identity import grpc_peer_host
from services.gateway.stream_limits import StreamLimits

GOOD = clone_body(stream=False)


def test_admission_bounds_each_client_and_the_total():
    a = StreamLimits(3, max_per_client=2)
    a.admit("key:a")
    a.admit("key:a")
    with pytest.raises(ResourceExhausted) as info:
        a.admit("key:a")
    assert info.value.retry_after_s == 1 and "this client" in info.value.message
    a.admit("key:b")
    with pytest.raises(ResourceExhausted):
        a.admit("key:c")  # the total bound
    a.release("key:a")
    a.admit("key:c")
    assert (a.active, a.active_for("key:a"), a.active_for("key:c")) == (3, 1, 1)


def test_grpc_peer_host():
    assert grpc_peer_host("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert grpc_peer_host("ipv6:[::1]:5555") == "::1"


async def test_one_key_cannot_take_every_slot_over_http():
    gw = build_gateway(max_streams=8, frames=20, chunk=1, delay_s=0.05)
    gw.synth.admission = StreamLimits(8, max_per_client=2)
    async with serve_http(gw) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        hog = {"authorization": "Bearer key-a"}
        held = [asyncio.create_task(c.post("/v1/audio/speech", json=GOOD, headers=hog)) for _ in range(2)]
        while gw.synth.admission.active < 2:
            await asyncio.sleep(0.01)
        refused = await c.post("/v1/audio/speech", json=GOOD, headers=hog)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        # Without API keys a client is its address: a new token is no way around the bound.
        dodge = await c.post("/v1/audio/speech", json=GOOD, headers={"authorization": "Bearer key-b"})
        assert dodge.status_code == 429
        local = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(base_url=gw.url, timeout=10, transport=local) as elsewhere:
            other = await elsewhere.post("/v1/audio/speech", json={**GOOD, "max_new_tokens": 2}, headers=hog)
        assert other.status_code == 200
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
    assert gw.synth.admission.active == 0


async def test_grpc_refusal_carries_retry_after_and_pushback():
    gw = build_gateway(max_streams=8, frames=20, chunk=1, delay_s=0.05)
    gw.synth.admission = StreamLimits(8, max_per_client=1)
    async with serve_grpc(gw) as stub:
        first = stub.Synthesize(grpc_request())
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Synthesize(grpc_request()):
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(info.value.trailing_metadata())
        assert trailers["retry-after"] == "1"
        # The pushback is the spread hint: 1 to 1.5 times the whole seconds.
        assert trailers["grpc-retry-pushback-ms"] == trailers["retry-after-ms"]
        assert 1000 <= int(trailers["retry-after-ms"]) < 1500
        first.cancel()


async def test_client_key_of_a_websocket_comes_from_its_api_key_parameter():
    from services.gateway.client_identity import ClientIdentityMiddleware, client_key, current_client

    seen = []

    async def app(scope, receive, send):
        seen.append(current_client())

    middleware = ClientIdentityMiddleware(app, keys_enabled=True)
    scope = {"type": "websocket", "headers": [], "client": ("10.0.0.9", 1), "query_string": b"api_key=k1"}
    await middleware(scope, None, None)
    await middleware({**scope, "query_string": b""}, None, None)
    assert seen == [client_key("k1", "", keys_enabled=True), "addr:10.0.0.9"]
    # Without API keys a client is its address, whatever key or token it sends.
    seen.clear()
    keyless = ClientIdentityMiddleware(app)
    await keyless(scope, None, None)
    await keyless({**scope, "headers": [(b"authorization", b"Bearer random-1")]}, None, None)
    assert seen == ["addr:10.0.0.9", "addr:10.0.0.9"]
