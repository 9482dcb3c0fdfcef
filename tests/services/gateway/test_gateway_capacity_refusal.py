"""The gateway refuses at once, from the talkers' published room, without calling a talker:
unit tests of the pool's placement, then a real gateway in front of a real gRPC talker whose
GetCapacity says it has no room, over HTTP, gRPC and WebSocket alike."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import json

import grpc
import httpx
import pytest
from gateway_fakes import fake_decode, free_port, wav_bytes
from test_gateway_server import FakeTalkerServicer, _start_talker
from websockets.asyncio.client import connect

from qtts.pb import talker_pb2, tts_pb2, tts_pb2_grpc
from qtts.request.errors import InvalidArgument, ResourceExhausted
from qtts.serving.log_context import CALLER_KEY
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer
from services.gateway.talker_pool import SLOW, Endpoint, Room, StaticResolver, TalkerPool, capacity_probe


async def ready_pool(rooms: dict[str, Room | None]) -> TalkerPool:
    async def probe(channel) -> bool:
        return True

    async def capacity(channel, caller) -> Room | None:
        return rooms[channel]

    pool = TalkerPool(
        StaticResolver(rooms), connect=lambda a: a, probe=probe, capacity=capacity, min_refresh_gap_s=0.0
    )
    await pool.refresh()
    await pool.poll_capacity()
    return pool


async def test_the_pool_places_streams_where_there_is_room_and_refuses_when_there_is_none():
    rooms = {"a:1": Room(0, 5), "b:1": Room(2, 4), "c:1": Room(0, 3)}
    pool = await ready_pool(rooms)
    leases = [pool.pick(), pool.pick()]
    assert [x.address for x in leases] == ["b:1", "b:1"]  # the only one with room, counted down
    assert isinstance(pool.refusal(), ResourceExhausted)  # a peek: no lease taken
    with pytest.raises(ResourceExhausted) as err:
        pool.pick()
    assert err.value.retry_after_s == 3 and "at capacity" in err.value.message  # the shortest hint
    rooms["a:1"] = None  # a talker that does not say: taken as having room
    await pool.poll_capacity()
    assert pool.refusal() is None and pool.pick().address == "a:1"
    leases[0].mark_full(9)  # a talker's own refusal: no room there until it publishes some
    assert pool.endpoints["b:1"].room == 0 and pool.endpoints["b:1"].retry_after_s == 9


def test_a_published_room_is_less_the_calls_sent_that_the_talker_had_not_seen():
    endpoint = Endpoint("a:1", None)
    endpoint.sent = 10
    endpoint.publish(Room(5, 2, calls_seen=7))  # 3 calls in flight: they take room once seen
    assert (endpoint.room, endpoint.retry_after_s) == (2, 2)
    endpoint.publish(Room(2, 1, calls_seen=10))
    assert endpoint.room == 2
    endpoint.publish(Room(1, 1, calls_seen=4))  # more in flight than room: none
    assert endpoint.room == -5 and not endpoint.has_room()
    endpoint.publish(Room(4, 1))  # a talker that does not count calls: its room as published
    assert endpoint.room == 4


async def started_pool(addresses: list[str], capacity, watch, **options) -> TalkerPool:
    """A started pool of always-ready fake talkers whose rooms `capacity` polls (every 10 ms) and
    `watch` pushes."""

    async def probe(channel) -> bool:
        return True

    pool = TalkerPool(
        StaticResolver(addresses),
        connect=lambda a: a,
        probe=probe,
        capacity=capacity,
        watch=watch,
        capacity_refresh_s=0.01,
        min_refresh_gap_s=0.0,
        **options,
    )
    await pool.refresh()
    pool.start()
    return pool


async def test_the_pool_takes_pushed_rooms_polls_only_talkers_without_the_watch_and_counts_its_calls():
    pushed: dict[str, asyncio.Queue] = {"a:1": asyncio.Queue(), "b:1": asyncio.Queue()}
    polled: list[str] = []
    callers: set[str] = set()

    async def watch(channel, caller):
        callers.add(caller)
        if channel == "b:1":  # an older talker
            raise FakeRpcError(grpc.StatusCode.UNIMPLEMENTED)
        while True:
            yield await pushed[channel].get()

    async def capacity(channel, caller):
        polled.append(channel)
        callers.add(caller)
        return Room(0, 9)

    pool = await started_pool(["a:1", "b:1"], capacity, watch)
    try:
        pushed["a:1"].put_nowait(Room(2, 1, calls_seen=0))
        await eventually(lambda: pool.endpoints["a:1"].watching and pool.endpoints["b:1"].watch_unsupported)
        polled.clear()
        await asyncio.sleep(0.05)
        assert set(polled) == {"b:1"}  # the watched one is not polled
        assert callers == {pool.caller} and len(pool.caller) == 32
        first, second = pool.pick(), pool.pick()
        assert [first.address, second.address] == ["a:1", "a:1"]  # b published no room
        assert first.metadata == ((CALLER_KEY, pool.caller),)
        with pytest.raises(ResourceExhausted):
            pool.pick()
        # The talker saw one of the two calls when it worked out this room: one is in flight.
        pushed["a:1"].put_nowait(Room(3, 1, calls_seen=1))
        await eventually(lambda: pool.endpoints["a:1"].room == 2)
        first.unsent()  # a call that could not be made: one the talker will never see
        pushed["a:1"].put_nowait(Room(3, 1, calls_seen=1))
        await eventually(lambda: pool.endpoints["a:1"].room == 3)
    finally:
        await pool.close()


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


async def test_a_talker_too_busy_to_answer_the_poll_keeps_its_last_room():
    rooms: dict[str, object] = {"a:1": Room(1, 4)}
    pool = await ready_pool(rooms)
    rooms["a:1"] = SLOW  # the poll timed out: its last room (1) stands, counted down
    await pool.poll_capacity()
    assert pool.pick().address == "a:1"
    await pool.poll_capacity()
    with pytest.raises(ResourceExhausted) as err:
        pool.pick()
    assert err.value.retry_after_s == 4
    rooms["a:1"] = None  # an answer that says nothing (an older talker): unknown, taken as room
    await pool.poll_capacity()
    assert pool.pick().address == "a:1"


async def test_the_probe_tells_a_timeout_from_a_talker_without_the_method():
    class Slow(FakeTalkerServicer):
        async def GetCapacity(self, request, context):  # noqa: N802 - gRPC method name
            await asyncio.sleep(1.0)
            return talker_pb2.GetCapacityResponse(accept=3)

    host, plain = await _start_talker(Slow()), await _start_talker(FakeTalkerServicer())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.bound_port}") as channel:
            assert await capacity_probe(channel, timeout_s=0.05) is SLOW
            assert await capacity_probe(channel, "gw", timeout_s=5.0) == Room(3, 1, None)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plain.bound_port}") as channel:
            assert await capacity_probe(channel) is None  # UNIMPLEMENTED: it does not say
    finally:
        await host.stop(0)
        await plain.stop(0)


def test_room_held_for_a_request_reading_its_body_counts_as_taken():
    """hold() keeps room for a request let in on its headers until it picks (in its own task's
    context) or lets go: a burst past the room is refused on its headers."""
    rooms = {"a:1": Room(2, 5)}
    pool = asyncio.run(ready_pool(rooms))
    first, second, third = (contextvars.copy_context() for _ in range(3))
    h1 = first.run(pool.hold)
    assert pool.refusal() is None  # 2 published, 1 held
    h2 = second.run(pool.hold)
    refused = pool.refusal()
    assert isinstance(refused, ResourceExhausted) and refused.retry_after_s == 5
    lease = first.run(pool.pick)  # its own hold is spent on the pick: no refusal for it
    assert lease.address == "a:1" and pool.endpoints["a:1"].room == 1
    assert isinstance(pool.refusal(), ResourceExhausted)  # 1 left, held by the second
    h2.release()
    h2.release()  # idempotent
    assert pool.refusal() is None
    h1.release()  # already taken by its pick: no effect
    assert third.run(pool.pick).address == "a:1" and isinstance(pool.refusal(), ResourceExhausted)
    rooms["a:1"] = None  # unknown room: holds refuse nothing
    asyncio.run(pool.poll_capacity())
    second.run(pool.hold)
    assert pool.refusal() is None


class FullTalker(FakeTalkerServicer):
    """A talker whose published room the test sets (accept 0 first)."""

    def __init__(self):
        super().__init__()
        self.accept = 0

    async def GetCapacity(self, request, context):
        return talker_pb2.GetCapacityResponse(accept=self.accept, retry_after_s=7)


BODY = {"input": "Hi.", "voice": "alice", "max_new_tokens": 2, "response_format": "pcm", "stream": False}


@contextlib.asynccontextmanager
async def gateway_before(talker: FakeTalkerServicer, **config: object):
    """A real gateway (its room polled every 20 ms) in front of `talker`, once it serves: the
    gateway, its config and an HTTP client of it."""
    talker_host = await _start_talker(talker)
    cfg = GatewayConfig(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=0,
        talker=f"127.0.0.1:{talker_host.bound_port}",
        speaker_cache=f"127.0.0.1:{free_port()}",
        drain_seconds=0.5,
        **config,
    ).validate()
    gateway = GatewayServer(cfg, catalog_retry_s=0.05, decode=fake_decode)
    gateway.talker_pool.capacity_refresh_s = 0.02
    await gateway.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cfg.http_port}", timeout=10) as c:
            for _ in range(200):
                if gateway.catalog is not None and gateway.talker_pool.usable():
                    break
                await asyncio.sleep(0.05)
            yield gateway, cfg, c
    finally:
        await gateway.stop()
        await talker_host.stop(0)


async def test_no_talker_with_room_is_a_refusal_at_once_over_http_grpc_and_websocket():
    talker = FullTalker()

    async with gateway_before(talker) as (gateway, config, c):
        url = f"http://127.0.0.1:{config.http_port}"
        await asyncio.sleep(0.1)  # a capacity poll or two
        r = await c.post("/v1/audio/speech", json=BODY)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "7" and "at capacity" in r.json()["error"]["message"]
        assert 7000 <= int(r.headers["retry-after-ms"]) < 10500  # spread: clients come back apart
        # Known from the headers: refused before the body is read (a storm's bodies cost nothing).
        r = await c.post(
            "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 429 and r.headers["retry-after"] == "7"

        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
            stub = tts_pb2_grpc.TextToSpeechServiceStub(channel)
            request = tts_pb2.SynthesizeRequest(text="Hi.", reference_audio=wav_bytes(), x_vector_only=True)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Synthesize(request)]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "7") in tuple(err.value.trailing_metadata() or ())
            # Refused before its fields are looked at, as HTTP before its body: no text at all.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Synthesize(tts_pb2.SynthesizeRequest())]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        async with connect(url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
            config_msg = {
                "type": "session.config",
                "ref_audio": base64.b64encode(wav_bytes()).decode(),
                "x_vector_only_mode": True,
                "response_format": "pcm",
            }
            await ws.send(json.dumps(config_msg))
            await ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
            await ws.send(json.dumps({"type": "input.done"}))
            events = []
            while not any(e.get("type") == "error" for e in events):
                msg = await asyncio.wait_for(ws.recv(), 5)
                if isinstance(msg, str):
                    events.append(json.loads(msg))
            error = next(e for e in events if e["type"] == "error")
            assert error["code"] == "rate_limit_exceeded" and "at capacity" in error["message"]
            assert 7000 <= error["retry_after_ms"] < 10500  # the same hint as HTTP's

        assert talker.requests == []  # refused at the gateway: the talker was never called
        # Room for one: the request holds it while its body is read, and its own pick takes
        # it (a hold left standing would have refused that very pick).
        talker.accept = 1
        await asyncio.sleep(0.1)
        r = await c.post("/v1/audio/speech", json=BODY)
        assert r.status_code == 200 and len(talker.requests) == 1
        assert gateway.talker_pool._held == 0


async def _watched_pool(room_wait_s: float, waits: list) -> tuple[TalkerPool, asyncio.Queue]:
    pushed: asyncio.Queue = asyncio.Queue()

    async def watch(channel, caller):
        while True:
            yield await pushed.get()

    async def capacity(channel, caller):
        return SLOW  # a poll that keeps the last room: the watch alone brings rooms

    pool = await started_pool(
        ["a:1"],
        capacity,
        watch,
        room_wait_s=room_wait_s,
        on_room_wait=lambda got, seconds: waits.append((got, seconds)),
    )
    return pool, pushed


async def test_a_request_finding_its_share_spent_waits_for_the_next_room_then_starts_or_is_refused():
    """The talker splits its room among the gateways; a burst at one gateway spends its share
    before the talker has seen its calls. Such a request waits for the next published room (up to
    `room_wait_s`) instead of being refused while the talker has room; one finding no room
    published at all is refused at once."""
    waits: list[tuple[bool, float]] = []
    pool, pushed = await _watched_pool(0.3, waits)
    try:
        pushed.put_nowait(Room(2, 1, calls_seen=0))
        await eventually(lambda: pool.endpoints["a:1"].room == 2)
        first, second = await pool.acquire(), await pool.acquire()
        assert pool.endpoints["a:1"].share_spent()
        assert pool.refusal() is None  # the peek lets it in: the wait decides
        third = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.02)
        assert not third.done()  # waiting for the next room, not refused
        pushed.put_nowait(Room(3, 1, calls_seen=2))  # the talker saw both calls, and has 3 more
        lease = await third
        assert lease.address == "a:1" and pool.endpoints["a:1"].room == 2
        assert waits and waits[-1][0] is True

        # The share spent again and no room comes: refused once the wait is over.
        for _ in range(2):
            await pool.acquire()
        with pytest.raises(ResourceExhausted):
            await pool.acquire()
        got, waited = waits[-1]
        assert got is False and waited >= 0.3

        # The talker publishes none: refused at once, no wait.
        pushed.put_nowait(Room(0, 4, calls_seen=pool.endpoints["a:1"].sent))
        await eventually(lambda: pool.endpoints["a:1"].published == 0)
        assert not pool.endpoints["a:1"].share_spent()
        assert isinstance(pool.refusal(), ResourceExhausted)
        count = len(waits)
        with pytest.raises(ResourceExhausted) as err:
            await pool.acquire()
        assert err.value.retry_after_s == 4 and len(waits) == count  # no wait recorded
        for held in (first, second, lease):
            held.release()
    finally:
        await pool.close()


async def test_a_talker_s_own_refusal_is_not_a_share_to_wait_for():
    waits: list[tuple[bool, float]] = []
    pool, pushed = await _watched_pool(5.0, waits)
    try:
        pushed.put_nowait(Room(3, 2, calls_seen=0))
        await eventually(lambda: pool.endpoints["a:1"].room == 3)
        lease = await pool.acquire()
        lease.mark_full(7)  # the talker refused the call at capacity
        assert not pool.endpoints["a:1"].share_spent()
        with pytest.raises(ResourceExhausted) as err:
            await pool.acquire()  # at once: a 5 s wait would fail this test's timeout budget
        assert err.value.retry_after_s == 7 and waits == []
    finally:
        await pool.close()


def test_the_gateway_flag_sets_the_wait():
    from services.gateway.config import config_from_args

    assert GatewayConfig().talker_room_wait_ms == 40.0
    assert config_from_args(["--talker-room-wait-ms", "0"]).talker_room_wait_ms == 0
    with pytest.raises(InvalidArgument, match="--talker-room-wait-ms"):
        config_from_args(["--talker-room-wait-ms", "-1"])


class SplitTalker(FakeTalkerServicer):
    """A talker that publishes room for one more request each time it has seen the gateway's calls
    (its share of a room split among gateways), and sees a call only once `gate` is open."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    async def GetCapacity(self, request, context):
        return talker_pb2.GetCapacityResponse(accept=1, retry_after_s=7, calls_seen=len(self.requests))

    async def Generate(self, request, context):
        await self.gate.wait()
        async for response in super().Generate(request, context):
            yield response


async def test_a_real_gateway_holds_a_request_whose_share_is_spent_until_the_talker_publishes_more():
    """Two requests at a gateway whose share is one: the second waits (it is neither refused nor
    sent) until the talker has seen the first call and publishes room again, then starts."""
    talker = SplitTalker()
    # The wait far longer than the test needs: the order decides, not a race.
    async with gateway_before(talker, talker_sessions=False, talker_room_wait_ms=1000) as (gateway, _, c):
        waited = lambda outcome: gateway.metrics.registry.get_sample_value(  # noqa: E731
            "tts_gateway_room_wait_seconds_count", {"outcome": outcome}
        )
        await eventually(lambda: all(e.room == 1 for e in gateway.talker_pool.endpoints.values()))
        first = asyncio.ensure_future(c.post("/v1/audio/speech", json=BODY))
        await eventually(lambda: all(e.share_spent() for e in gateway.talker_pool.endpoints.values()))
        second = asyncio.ensure_future(c.post("/v1/audio/speech", json=BODY))
        await asyncio.sleep(0.2)  # rooms come every 20 ms, each still 1 less the unseen call
        assert not second.done() and talker.requests == []
        talker.gate.set()  # the talker sees the first call, and its next room has one more
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        assert len(talker.requests) == 2
        assert waited("room") == 1 and not waited("refused")
