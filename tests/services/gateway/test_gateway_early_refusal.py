"""At the stream limit, POST /v1/audio/speech is refused on its headers, before its body is read: a
refusal storm of voice clones (each body carrying its clip) must not cost the event loop the
receive and parse of every refused body (real uvicorn, raw sockets, a fake talker held open)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from gateway_fakes import FakeTalker, build_gateway, clone_body, free_port

from qtts.request.errors import ResourceExhausted
from services.gateway.auth import ApiKeys
from services.gateway.http_app import HttpDeps, create_app
from services.gateway.http_metrics import HttpMetricsMiddleware
from services.gateway.server import _UvicornServer
from services.gateway.stream_limits import StreamLimits

GOOD = clone_body(stream=False)
AT_LIMIT = {
    "error": {
        "message": "server is at its limit of 2 concurrent streams; retry later",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}


@dataclass
class GatedTalker(FakeTalker):
    """A FakeTalker whose streams wait for `gate` before their first event: each holds its slot."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def generate(self, job, text=None):
        await self.gate.wait()
        async for event in super().generate(job, text):
            yield event


class BodyCounter:
    """Counts the request body bytes the app takes from uvicorn (`receive`), per path."""

    def __init__(self, app):
        self.app = app
        self.read: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                self.read[scope["path"]] = self.read.get(scope["path"], 0) + len(message.get("body", b""))
            return message

        await self.app(scope, counted, send)


def gated_gateway(max_streams: int = 2, max_per_client: int = 0):
    gw = build_gateway(max_streams=max_streams)
    gw.talker = GatedTalker(frames=2, chunk=1)
    gw.synth.talker = gw.talker
    gw.synth.admission = StreamLimits(max_streams, max_per_client=max_per_client)
    return gw


@contextlib.asynccontextmanager
async def serve(gw, **deps):
    """The app as server.py stacks it (with the per-route metrics), on a real uvicorn server."""

    async def stage_health():
        return {"talker": "SERVING", "speaker_cache": "SERVING"}

    app = create_app(HttpDeps(gw.synth, gw.voice_service, gw.metrics, stage_health, **deps))
    app.add_middleware(HttpMetricsMiddleware, metrics=gw.metrics)
    counter = BodyCounter(app)
    port = free_port()
    server = _UvicornServer(
        uvicorn.Config(
            counter,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    gw.url, gw.port, gw.body_read = f"http://127.0.0.1:{port}", port, counter.read
    try:
        yield gw
    finally:
        gw.talker.gate.set()  # a failed test must not leave the server waiting on held streams
        server.should_exit = True
        await task


async def hold(c: httpx.AsyncClient, gw, n: int, headers: dict | None = None) -> list[asyncio.Task]:
    """`n` requests admitted and held (their talker streams wait on the gate)."""
    before = gw.synth.admission.active
    held = [asyncio.create_task(c.post("/v1/audio/speech", json=GOOD, headers=headers)) for _ in range(n)]
    while gw.synth.admission.active < before + n:
        await asyncio.sleep(0.01)
    return held


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length: status line, headers (lower-cased), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    return status.encode(), headers, body


def metric(gw, name: str, **labels) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


def test_refusal_is_a_peek_that_takes_no_slot():
    a = StreamLimits(2, max_per_client=1)
    assert a.refusal("key:a") is None and a.active == 0  # a peek: no slot taken
    a.admit("key:a")
    assert a.refusal("key:a") is not None and a.refusal("key:b") is None and a.refusal("") is None
    assert "this client" in a.refusal("key:a").message and a.refusal("key:a").retry_after_s == 1
    assert (a.active, a.active_for("key:a"), a.active_for("key:b")) == (1, 1, 0)
    a.admit("key:b")
    refused = a.refusal("key:c")
    assert a.refusal("key:c") is not None and refused.retry_after_s == 1
    assert refused.message == "server is at its limit of 2 concurrent streams; retry later"
    assert (a.active, a.active_for("key:c")) == (2, 0)
    a.release("key:a")
    assert a.refusal("key:c") is None and a.refusal("key:b") is not None


def test_a_held_slot_counts_as_taken_until_admitted_or_let_go():
    a = StreamLimits(2)
    a.hold()
    a.hold()
    assert a.refusal() is not None and (a.active, a.held) == (0, 2)
    a.admit(held=True)  # the held slot becomes the stream's
    assert (a.active, a.held) == (1, 1) and a.refusal() is not None
    a.unhold()
    assert a.refusal() is None
    a.admit()
    a.hold()
    with pytest.raises(ResourceExhausted):
        a.admit(held=True)  # over the limit: refused, and the hold is spent all the same
    assert (a.active, a.held) == (2, 0)
    with pytest.raises(RuntimeError):
        a.unhold()


async def test_a_refusal_at_the_limit_comes_before_the_body_is_read():
    gw = gated_gateway(max_streams=2)
    async with serve(gw) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = await hold(c, gw, 2)
        read_before = gw.body_read.get("/v1/audio/speech", 0)
        errors_before = metric(gw, "tts_errors_total", service="gateway", code="RESOURCE_EXHAUSTED")

        # A 4 MB body announced; only its first 64 KB sent: the answer must come without the rest.
        size = 4 << 20
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % size
        )
        writer.write(b" " * 65536)
        await writer.drain()
        status, headers, body = await read_response(reader)
        assert status.startswith(b"HTTP/1.1 429")
        assert json.loads(body) == AT_LIMIT
        assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
        assert "connection" not in headers  # kept alive: uvicorn discards the unread body
        assert gw.body_read.get("/v1/audio/speech", 0) == read_before  # not a byte of it taken
        assert (
            metric(gw, "tts_errors_total", service="gateway", code="RESOURCE_EXHAUSTED") == errors_before + 1
        )
        assert (
            metric(gw, "tts_http_requests_total", route="/v1/audio/speech", method="POST", status="429") == 1
        )

        # The rest of the body goes, unread, and the connection carries the next request.
        writer.write(b" " * (size - 65536))
        writer.write(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        status, _, body = await read_response(reader)
        assert status.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
        writer.close()
        assert gw.body_read.get("/v1/audio/speech", 0) == read_before

        # Once a slot frees, a request on a new connection goes on as ever.
        gw.talker.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        r = await c.post("/v1/audio/speech", json=GOOD)
        assert r.status_code == 200 and r.content
    assert gw.synth.admission.active == 0 and len(gw.talker.jobs) == 3


async def test_the_refusal_middleware_answers_ahead_of_the_app_and_names_the_route():
    """EarlyRefusalMiddleware: a speech POST the gateway would refuse is answered without the app
    behind it (FastAPI's routing), the route set for the per-route metrics; anything else, or a
    request let in, reaches the app."""
    from services.gateway.http_app import error_response
    from services.gateway.http_refusal import EarlyRefusalMiddleware

    reached: list[str] = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    busy: list[ResourceExhausted | None] = [ResourceExhausted("full; retry later", retry_after_s=3)]
    route = object()
    middleware = EarlyRefusalMiddleware(
        inner, refusal=lambda: busy[0], respond=lambda exc: error_response(exc), route=lambda: route
    )
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        raise AssertionError("the body is not read")

    def scope(method: str = "POST", path: str = "/v1/audio/speech", kind: str = "http") -> dict:
        return {"type": kind, "method": method, "path": path, "headers": []}

    refused = scope()
    await middleware(refused, receive, send)
    assert reached == [] and refused["route"] is route
    assert sent[0]["status"] == 429 and (b"retry-after", b"3") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "rate_limit_exceeded"
    for other in (scope("GET"), scope(path="/v1/audio/voices"), scope(kind="websocket", path="/x")):
        await middleware(other, receive, send)
    busy[0] = None
    await middleware(scope(), receive, send)
    assert reached == ["/v1/audio/speech", "/v1/audio/voices", "/x", "/v1/audio/speech"]


async def test_a_request_reading_its_body_holds_its_slot_and_a_burst_is_refused_on_headers():
    """A request let in on its headers holds its slot while its body comes: the next one past the
    limit is refused unread (a peek alone let it in, to be refused after its body); the held one
    is then admitted, and a held request whose body is bad lets its slot go."""
    gw = gated_gateway(max_streams=2)
    async with serve(gw) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = await hold(c, gw, 1)
        body = json.dumps(GOOD).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/audio/speech HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        writer.write(body[:100])
        await writer.drain()
        while gw.synth.admission.held < 1:
            await asyncio.sleep(0.01)
        read_before = gw.body_read.get("/v1/audio/speech", 0)

        r = await c.post("/v1/audio/speech", json=GOOD)
        assert r.status_code == 429 and r.json() == AT_LIMIT
        assert gw.body_read["/v1/audio/speech"] == read_before  # refused unread

        writer.write(body[100:])
        await writer.drain()
        while gw.synth.admission.active < 2:
            await asyncio.sleep(0.01)
        assert gw.synth.admission.held == 0  # the hold became the admission
        gw.talker.gate.set()
        status, _, audio = await read_response(reader)
        assert status.startswith(b"HTTP/1.1 200") and audio
        writer.close()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200]

        bad = await c.post("/v1/audio/speech", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and gw.synth.admission.held == 0
    assert gw.synth.admission.active == 0


async def test_the_early_refusal_is_the_handlers_refusal_to_the_byte(monkeypatch):
    """A slot taken between the peek and the handler's admit() is refused there, after the body: the
    two answers (status, headers, body) and what they count are the same."""
    gw = gated_gateway(max_streams=2)
    async with serve(gw) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = await hold(c, gw, 2)
        early = await c.post("/v1/audio/speech", json=GOOD)
        read_early = gw.body_read.get("/v1/audio/speech", 0)
        monkeypatch.setattr(gw.synth, "early_refusal", lambda: None)  # the peek saw a free slot
        late = await c.post("/v1/audio/speech", json=GOOD)
        assert gw.body_read["/v1/audio/speech"] > read_early  # this one was read, then refused
        gw.talker.gate.set()
        await asyncio.gather(*held)

    def strip(headers: httpx.Headers) -> list[tuple[str, str]]:
        # retry-after-ms is drawn afresh for each refusal (checked apart below).
        return [
            (k, v) for k, v in headers.multi_items() if k not in ("date", "x-request-id", "retry-after-ms")
        ]

    assert early.status_code == late.status_code == 429
    assert early.content == late.content and json.loads(early.content) == AT_LIMIT
    assert strip(early.headers) == strip(late.headers) and early.headers["retry-after"] == "1"
    assert all(1000 <= int(r.headers["retry-after-ms"]) < 1500 for r in (early, late))
    assert metric(gw, "tts_errors_total", service="gateway", code="RESOURCE_EXHAUSTED") == 2
    assert metric(gw, "tts_http_requests_total", route="/v1/audio/speech", method="POST", status="429") == 2
    # Both are counted among the requests' outcomes, as any request refused before admission.
    assert metric(gw, "tts_gateway_requests_total", protocol="http", status="resource_exhausted") == 2


async def test_a_client_at_its_own_bound_is_refused_early_and_others_go_on():
    gw = gated_gateway(max_streams=8, max_per_client=2)
    hog, other = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
    # A key is a client with API keys on (without them a client is its address).
    keys = ApiKeys(["key-a", "key-b"])
    async with serve(gw, api_keys=keys) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = await hold(c, gw, 2, headers=hog)
        read_before = gw.body_read.get("/v1/audio/speech", 0)
        # Not even valid JSON: at its bound the client is refused before the body is looked at.
        refused = await c.post("/v1/audio/speech", content=b"x" * 200_000, headers=hog)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "this client already has 2 concurrent streams" in refused.json()["error"]["message"]
        assert gw.body_read.get("/v1/audio/speech", 0) == read_before
        # Below the limits nothing changed: another key's bad body is read and is a 400.
        bad = await c.post("/v1/audio/speech", content=b"x" * 1000, headers=other)
        assert bad.status_code == 400
        assert gw.body_read["/v1/audio/speech"] == read_before + 1000
        gw.talker.gate.set()
        assert (await c.post("/v1/audio/speech", json=GOOD, headers=other)).status_code == 200
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]


@pytest.mark.parametrize("key", [None, "wrong"])
async def test_authentication_still_comes_first_at_the_limit(key):
    gw = gated_gateway(max_streams=2)
    keys = ApiKeys(["key-a"])
    async with serve(gw, api_keys=keys) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = await hold(c, gw, 2, headers={"authorization": "Bearer key-a"})
        headers = {"authorization": f"Bearer {key}"} if key else {}
        r = await c.post("/v1/audio/speech", json=GOOD, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/audio/speech", json=GOOD, headers={"authorization": "Bearer key-a"})
        assert r.status_code == 429 and r.json() == AT_LIMIT
        gw.talker.gate.set()
        await asyncio.gather(*held)


async def test_while_draining_the_drain_refusal_is_unchanged():
    """cut_all() refuses new streams with its own error after the body is checked: the early
    check does not turn that into a 429."""
    from qtts.request.errors import Unavailable

    gw = gated_gateway(max_streams=2)
    async with serve(gw) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as c:
        held = await hold(c, gw, 2)
        gw.synth.cut_all(Unavailable("the gateway is shutting down"))
        r = await c.post("/v1/audio/speech", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400  # the body is still read and checked first
        r = await c.post("/v1/audio/speech", json=GOOD)
        assert r.status_code == 503
        gw.talker.gate.set()
        await asyncio.gather(*held)
