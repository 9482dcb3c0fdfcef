"""The room the talker publishes (services/talker/room.py): each gateway's calls seen, counted from
its `x-tts-caller` metadata, GetCapacity and WatchCapacity through a real talker, and the watch's
pushes (at once, on change, on the heartbeat) and its end when the talker drains."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import grpc
import pytest

import services.talker.servicer as servicer_module
from qtts.pb import talker_pb2
from qtts.serving.log_context import CALLER_KEY
from services.talker.forecast import Headroom
from services.talker.room import FrontRoom, RoomNews, SeenCalls, published_room, watch_room
from tests.services.talker.fakes import FakeBundle, FakeCode2Wav, FakeGenerator, FakeSpec
from tests.services.talker.stack import eventually, talker_stack
from tests.services.talker.test_talker_capacity import stack
from tests.services.talker.test_talker_service import CLONE


def test_calls_are_counted_per_caller_and_bounded():
    seen = SeenCalls(max_callers=2)
    seen.saw(((CALLER_KEY, "a"), ("x-request-id", "r1")))
    seen.saw(((CALLER_KEY, "a"),))
    seen.saw(((CALLER_KEY, "b"),))
    seen.saw((("x-request-id", "r2"),))  # no caller: not counted
    seen.saw(None)
    assert (seen.seen("a"), seen.seen("b"), seen.seen("")) == (2, 1, 0)
    seen.saw(((CALLER_KEY, "c"),))  # a third caller: the least recent ("a") is forgotten
    assert (seen.seen("a"), seen.seen("b"), seen.seen("c")) == (0, 1, 1)


async def test_the_calls_seen_are_read_before_the_room_is_worked_out():
    """A call seen while the room is worked out counts in the room, not in the calls seen: the
    gateway takes it off twice (one request too few), never lets one more in."""
    seen = SeenCalls()

    async def headroom():
        seen.saw(((CALLER_KEY, "g"),))  # arrives meanwhile
        return Headroom(start_now=1, accept=3, retry_after_s=0, running=2, waiting=0)

    heard: list[tuple[float, int]] = []
    clock = iter([10.0, 10.25, 20.0, 20.5])
    msg = await published_room(
        headroom, seen, "g", lambda s, n: heard.append((s, n)), clock=lambda: next(clock)
    )
    assert (msg.accept, msg.calls_seen, msg.running) == (3, 0, 2)
    assert seen.seen("g") == 1
    # What it cost and whom it counted twice: 0.25 s to work out, one of g's calls seen meanwhile.
    assert heard == [(0.25, 1)]
    anonymous = await published_room(
        headroom, seen, "", lambda s, n: heard.append((s, n)), clock=lambda: next(clock)
    )
    assert not anonymous.HasField("calls_seen")  # no caller: nothing to say
    assert heard[-1] == (0.5, 0)


async def test_the_watch_pushes_at_once_on_change_and_on_the_heartbeat_then_ends_when_stopping():
    rooms = [Headroom(1, 2, 0, 0, 0)]
    seen, stopping, now = SeenCalls(), asyncio.Event(), [0.0]

    async def headroom():
        return rooms[-1]

    got: list = []

    async def consume():
        async for msg in watch_room(headroom, seen, "g", stopping, interval_s=0.001, clock=lambda: now[0]):
            got.append((msg.accept, msg.calls_seen))

    task = asyncio.create_task(consume())
    await eventually(lambda: got == [(2, 0)])
    await asyncio.sleep(0.02)
    assert got == [(2, 0)]  # nothing changed: nothing sent
    rooms.append(Headroom(0, 0, 3, 1, 0))
    await eventually(lambda: got[-1] == (0, 0))
    seen.saw(((CALLER_KEY, "g"),))  # a call seen is a change too
    await eventually(lambda: got[-1] == (0, 1))
    count = len(got)
    now[0] = 5.0  # a heartbeat is due: the same room again
    await eventually(lambda: len(got) == count + 1)
    assert got[-1] == (0, 1)
    stopping.set()
    await asyncio.wait_for(task, 1.0)


async def test_news_wakes_the_watch_between_its_checks_and_returns_once_the_room_is_sent():
    rooms = [Headroom(0, 0, 3, 1, 0)]
    seen, stopping, news = SeenCalls(), asyncio.Event(), RoomNews()

    async def headroom():
        return rooms[-1]

    got: list[int] = []

    async def consume():
        async for msg in watch_room(headroom, seen, "g", stopping, news=news, interval_s=60.0):
            got.append(msg.accept)

    task = asyncio.create_task(consume())
    await eventually(lambda: got == [0])
    rooms.append(Headroom(1, 1, 0, 0, 0))  # a stream's error freed its room
    assert await news.publish()  # no minute's wait for the next check
    assert got == [0, 1]  # sent before publish returned
    assert await news.publish()  # nothing changed: nothing sent, and nothing to wait for
    assert got == [0, 1]
    stopping.set()
    assert await news.publish()  # the watch ends: nobody to wait for
    await asyncio.wait_for(task, 1.0)
    assert await news.publish()  # no watch: at once


class _MidwayFailingGenerator(FakeGenerator):
    """The next step fails once `fail` is set, as tests/e2e/device_fault.py's MIDWAY step does."""

    def __init__(self, bundle=None, max_batch=64, *, fail: threading.Event):
        super().__init__(bundle, max_batch)
        self.fail = fail

    def step(self, skip=()):
        if self.fail.is_set():
            self.fail.clear()
            raise ValueError("the step failed midway through the stream")
        return super().step(skip)


async def test_a_stream_that_fails_midway_frees_its_room_before_its_error_goes_out(monkeypatch):
    """A talker full with one stream (the CPU stand-in stack whose one-stream step took the whole
    duty bound) publishes the room that stream's failure frees before the failure's status: the
    gateway passes the error on at once, and the client's next request, there within milliseconds,
    found the gateway still holding the room of 0 from before, and got 429 "every talker is at
    capacity" (tests/e2e/test_e2e_clear_ends.py). The watch's own checks come a second apart here,
    so only the news of the freed room can bring it in time."""
    monkeypatch.setattr(servicer_module, "watch_room", functools.partial(watch_room, interval_s=1.0))
    fail = threading.Event()
    async with talker_stack(
        [FakeCode2Wav("c2w-a")],
        bundle=FakeBundle("base"),
        generator_factory=lambda bundle, max_batch: _MidwayFailingGenerator(bundle, max_batch, fail=fail),
        spec_factory=FakeSpec,
        max_batch=1,
        max_queue=0,
    ) as s:
        watch = s.stub.WatchCapacity(talker_pb2.GetCapacityRequest(caller="gw"))
        assert (await watch.read()).accept == 1
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(request_id="midway", text="frames=100000 slow", **CLONE),
            metadata=((CALLER_KEY, "gw"),),
        )
        await call.read()  # audio flows
        while (await asyncio.wait_for(watch.read(), 5.0)).accept != 0:  # the talker is full
            pass
        heard: list[tuple[str, object]] = []

        async def rooms() -> None:
            while (msg := await watch.read()) is not grpc.aio.EOF:
                heard.append(("room", msg.accept))

        reader = asyncio.create_task(rooms())
        fail.set()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
        heard.append(("error", info.value.code()))
        assert heard[0] == ("room", 1), heard  # the freed room came first, on the same connection
        assert heard[-1] == ("error", grpc.StatusCode.INTERNAL), heard
        watch.cancel()
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await reader


async def test_a_real_talker_counts_each_gateway_s_calls_and_pushes_its_room():
    async with stack([FakeCode2Wav("c2w-a")], max_batch=1, max_queue=0) as s:
        watch = s.stub.WatchCapacity(talker_pb2.GetCapacityRequest(caller="gw-1"))
        first = await watch.read()
        assert (first.accept, first.calls_seen) == (1, 0)
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(request_id="a", text="frames=100000 slow", **CLONE),
            metadata=((CALLER_KEY, "gw-1"),),
        )
        await call.read()
        full = await asyncio.wait_for(watch.read(), 5.0)
        assert (full.accept, full.calls_seen, full.running) == (0, 1, 1)
        assert full.retry_after_s >= 1
        polled = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest(caller="gw-1"))
        other = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest(caller="gw-2"))
        assert (polled.calls_seen, other.calls_seen) == (1, 0)
        call.cancel()
        freed = await asyncio.wait_for(watch.read(), 5.0)
        assert freed.accept == 1
        # Every room sent is in the talker's histogram: the watch's messages (1, 0, then 1 again)
        # and the two polls while the one slot was taken (0 each).
        registry = s.talker.metrics.registry
        sent = registry.get_sample_value("tts_talker_published_room_streams_count")
        none = registry.get_sample_value("tts_talker_published_room_streams_bucket", {"le": "0.0"})
        at_most_one = registry.get_sample_value("tts_talker_published_room_streams_bucket", {"le": "1.0"})
        assert sent >= 5 and none >= 3 and at_most_one == sent
        # Each of them was worked out once, and timed.
        assert registry.get_sample_value("tts_talker_room_seconds_count") == sent
        assert registry.get_sample_value("tts_talker_room_calls_seen_meanwhile_count") == sent
        started = time.monotonic()
        # The drain ends the watch instead of waiting out its grace (20 s: a loaded CI host took
        # 4 s once to end it, so the bound stays well clear of the timing of the stop itself).
        await s.talker.stop(20.0)
        while await watch.read() is not grpc.aio.EOF:
            pass
        assert await watch.code() == grpc.StatusCode.OK
        assert time.monotonic() - started < 15.0


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
async def test_both_generate_methods_are_counted_whatever_their_outcome(method):
    async with stack([FakeCode2Wav("c2w-a")]) as s:
        request = talker_pb2.GenerateRequest(request_id="a", text="frames=2", **CLONE)
        metadata = ((CALLER_KEY, "gw"),)
        if method == "Generate":
            call = s.stub.Generate(request, metadata=metadata)
        else:
            call = s.stub.GenerateStream(
                iter([talker_pb2.GenerateStreamRequest(start=request)]), metadata=metadata
            )
        with contextlib.suppress(grpc.aio.AioRpcError):  # the fakes take no streamed text
            [m async for m in call]
        room = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest(caller="gw"))
        assert room.calls_seen == 1


async def test_gateways_share_the_room_by_the_calls_they_send_and_a_quiet_one_still_gets_some():
    now = [100.0]
    seen = SeenCalls(clock=lambda: now[0])

    async def headroom():
        return Headroom(start_now=10, accept=10, retry_after_s=0, running=0, waiting=0)

    alone = await published_room(headroom, seen, "busy")
    assert alone.accept == 10  # the only caller asking: the whole room
    for _ in range(40):  # 40 calls over the last second from "busy", none from "quiet"
        now[0] += 0.025
        seen.saw(((CALLER_KEY, "busy"),))
    quiet = await published_room(headroom, seen, "quiet")
    busy = await published_room(headroom, seen, "busy")
    assert quiet.accept == 1 and 9 <= busy.accept <= 10  # about all of it, with one for "quiet"
    for _ in range(40):  # now both send alike
        now[0] += 0.025
        seen.saw(((CALLER_KEY, "quiet"),))
        seen.saw(((CALLER_KEY, "busy"),))
    shares = [(await published_room(headroom, seen, c)).accept for c in ("quiet", "busy")]
    assert 3 <= shares[0] <= shares[1] <= 7 and sum(shares) <= 11
    now[0] += 10.0  # "quiet" stopped asking: "busy" alone again
    assert (await published_room(headroom, seen, "busy")).accept == 10


async def test_a_share_floor_keeps_a_gateway_whose_burst_comes_later_from_starving():
    """A level's opening: one gateway's calls have been coming (here 10 a second for 2 s, as a
    probe's), three more gateways ask for their room as their own bursts begin. By the calls
    seen alone each of the three gets a few of 100; with `--room-share-floor 1` each gets at least
    an equal split (25), and all four together at most twice the room."""
    now = [100.0]

    async def headroom():
        return Headroom(start_now=100, accept=100, retry_after_s=0, running=0, waiting=0)

    def seen_with(floor: float) -> SeenCalls:
        seen = SeenCalls(clock=lambda: now[0], share_floor=floor)
        for _ in range(20):
            now[0] += 0.1
            seen.saw(((CALLER_KEY, "a"),))
        return seen

    late = {}
    for floor in (0.0, 1.0):
        seen = seen_with(floor)
        rooms = {c: (await published_room(headroom, seen, c)).accept for c in "abcd"}
        rooms = {c: (await published_room(headroom, seen, c)).accept for c in "abcd"}  # all asking now
        assert rooms["b"] == rooms["c"] == rooms["d"]
        assert rooms["a"] >= 70 and sum(rooms.values()) <= 2 * 100 + 4
        late[floor] = rooms["b"]
    assert late[0.0] <= 10 and late[1.0] == 25
    with pytest.raises(ValueError, match="share_floor"):
        SeenCalls(share_floor=1.5)


def test_the_share_floor_flag_is_checked():
    from qtts.request.errors import InvalidArgument
    from services.talker.config import TalkerConfig, config_from_args

    assert config_from_args([]).room_share_floor == 0.0
    assert config_from_args(["--room-share-floor", "1"]).room_share_floor == 1.0
    with pytest.raises(InvalidArgument, match="--room-share-floor must be in"):
        TalkerConfig(room_share_floor=-0.5).validate()
    with pytest.raises(SystemExit):  # the command line says so and exits
        config_from_args(["--room-share-floor", "2"])


def test_the_front_refuses_while_the_engine_s_last_room_is_spent_and_fresh():
    """room.FrontRoom: the engine's last room less the builds sent since; stale or idle: no say."""
    now = [0.0]
    front = FrontRoom(fresh_s=0.05, clock=lambda: now[0])
    assert front.refusal() is None  # no room heard yet: the engine decides
    front.build_sent()
    sent = front.asking()  # the build above is counted in the room asked for now
    front.heard(Headroom(start_now=0, accept=2, retry_after_s=0, running=5, waiting=1), sent)
    assert front.refusal() is None  # two more accepted
    front.build_sent()
    assert front.refusal() is None  # one more
    front.build_sent()
    refusal = front.refusal()
    assert refusal is not None
    assert (
        "the talker is at capacity: no room for another request (5 streams generating, 1 waiting"
        in refusal.message
    )
    assert refusal.retry_after_s == 1  # at least a second, where the room said 0
    now[0] = 0.051  # the room is stale: the engine decides again
    assert front.refusal() is None
    # A build sent while the room was being worked out (after asking) is not in it.
    sent = front.asking()
    front.build_sent()
    front.heard(Headroom(start_now=0, accept=1, retry_after_s=3, running=5, waiting=0), sent)
    refusal = front.refusal()
    assert refusal is not None and refusal.retry_after_s == 3
    # An idle talker's "no room" (draining, or no estimate) is the engine's to say.
    front.heard(Headroom(start_now=0, accept=0, retry_after_s=1, running=0, waiting=0), front.asking())
    assert front.refusal() is None
