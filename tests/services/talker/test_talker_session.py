"""`talker.v1.TalkerService/Session`: many Generate requests on one call, the talker's end
(services/talker/session.py) and the gateway's (services/gateway/talker_session.py), through a
real gRPC server with the services' interceptor. Each stream behaves as a Generate call would:
the same responses, the same statuses and retry hints, a cancel that frees its work, and the
same counts under the Generate method."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.errors import InvalidArgument, ResourceExhausted, from_grpc
from qtts.serving.grpc_server import GrpcServiceHost
from qtts.serving.log_context import outgoing_metadata
from qtts.serving.metrics import TalkerMetrics
from services.gateway.talker_session import TalkerSession
from services.talker.room import CALLER_KEY, SeenCalls
from services.talker.session import GENERATE, GENERATE_STREAM, SessionServer

SERVICE = "talker.v1.TalkerService"


def audio(request_id: str, seq: int) -> talker_pb2.GenerateResponse:
    return talker_pb2.GenerateResponse(
        request_id=request_id,
        sequence_number=seq,
        audio=tts_pb2.AudioChunk(
            audio=bytes([seq % 256]) * 64, num_samples=32, first_frame_index=seq, num_frames=1
        ),
    )


class Behaviour:
    """What the stand-in Generate path does, by the request's text."""

    def __init__(self):
        self.cancelled: list[str] = []
        self.started: list[str] = []

    async def stream(self, request: talker_pb2.GenerateRequest, appended=None):
        rid, text = request.request_id, request.text
        self.started.append(rid)
        if appended is not None:  # text follows: one chunk per piece, its text in the audio bytes
            yield talker_pb2.GenerateResponse(request_id=rid, audio=tts_pb2.AudioChunk(audio=text.encode()))
            async for piece, final in appended:
                yield talker_pb2.GenerateResponse(
                    request_id=rid, audio=tts_pb2.AudioChunk(audio=piece.encode(), num_frames=int(final))
                )
            yield talker_pb2.GenerateResponse(request_id=rid, summary=talker_pb2.GenerateSummary())
            return
        if text.startswith(("ok:", "slow:")):  # slow: 10 ms a chunk
            kind, n = text.split(":")
            for seq in range(int(n)):
                await asyncio.sleep(0.01 if kind == "slow" else 0)
                yield audio(rid, seq)
            yield talker_pb2.GenerateResponse(
                request_id=rid, summary=talker_pb2.GenerateSummary(num_frames=int(n))
            )
        elif text == "refuse":
            raise ResourceExhausted("the talker is at capacity", retry_after_s=3)
        elif text == "invalid":
            raise InvalidArgument("no such voice", param="voice")
        elif text == "crash":
            raise RuntimeError("boom")
        elif text == "endless":
            seq = 0
            try:
                while True:
                    yield audio(rid, seq)
                    seq += 1
                    await asyncio.sleep(0.005)
            except (asyncio.CancelledError, GeneratorExit):
                self.cancelled.append(rid)
                raise


class Servicer(talker_pb2_grpc.TalkerServiceServicer):
    def __init__(self, behaviour: Behaviour, metrics: TalkerMetrics):
        self.seen = SeenCalls()
        self.stopping = asyncio.Event()
        self.sessions = SessionServer(behaviour.stream, self.seen, self.stopping)
        self.sessions.metrics = metrics

    async def Session(self, request_iterator, context):  # noqa: N802 - gRPC method name
        async with contextlib.aclosing(self.sessions.serve(request_iterator)) as msgs:
            async for msg in msgs:
                yield msg

    def drain(self):
        self.stopping.set()
        self.sessions.wake_all()


@contextlib.asynccontextmanager
async def talker(servicer_cls: type = Servicer):
    metrics = TalkerMetrics(CollectorRegistry())
    behaviour = Behaviour()
    host = GrpcServiceHost(service_names=[SERVICE], metrics=metrics, drain_seconds=2.0)
    servicer = servicer_cls(behaviour, metrics) if issubclass(servicer_cls, Servicer) else servicer_cls()
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(servicer, host.server)
    if hasattr(servicer, "drain"):
        host.add_drain_callback(servicer.drain)
    port = await host.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield host, servicer, behaviour, metrics, channel
    finally:
        await channel.close()
        await host.stop(0)


def request(rid: str, text: str) -> talker_pb2.GenerateRequest:
    return talker_pb2.GenerateRequest(request_id=rid, text=text)


async def ready(session: TalkerSession) -> TalkerSession:
    """The session once its call has answered: streams go on it from then on."""
    from tests.grpc_helpers import wait_until

    session._calls.current()  # opens the call
    await wait_until(lambda: session._calls.current() is not None, what="the talker's first message")
    return session


def stream_on(session: TalkerSession, rid: str, text: str, metadata=(), appended=None):
    stream = session.open(request(rid, text), metadata or outgoing_metadata(rid), appended)
    assert stream is not None, "no session call has answered"
    return stream


async def collect(session: TalkerSession, rid: str, text: str, metadata=()):
    return [m async for m in stream_on(session, rid, text, metadata)]


def calls(metrics: TalkerMetrics, method: str, code: str) -> float:
    labels = {"service": "talker", "method": method, "code": code}
    return metrics.registry.get_sample_value("tts_rpc_requests_total", labels) or 0.0


async def test_many_requests_share_one_call_and_each_gets_what_generate_gives():
    async with talker() as (_, servicer, behaviour, metrics, channel):
        session = await ready(TalkerSession(channel))
        caller = ((CALLER_KEY, "gw-1"),)
        got = await asyncio.gather(
            *(
                collect(session, f"r{i}", f"ok:{i + 1}", outgoing_metadata(f"r{i}") + caller)
                for i in range(40)
            )
        )
        for i, msgs in enumerate(got):
            assert [m.WhichOneof("event") for m in msgs] == ["audio"] * (i + 1) + ["summary"]
            assert [m.audio.first_frame_index for m in msgs[:-1]] == list(range(i + 1))
            assert all(m.request_id == f"r{i}" for m in msgs) and msgs[-1].summary.num_frames == i + 1
        # One call carried them; each is counted as the Generate call it stands for.
        assert calls(metrics, GENERATE, "OK") == 40
        assert calls(metrics, f"/{SERVICE}/Session", "OK") == 0  # still open
        accept = metrics.registry.get_sample_value(
            "tts_rpc_accept_seconds_count", {"service": "talker", "method": GENERATE}
        )
        assert accept == 40  # the wait since the gateway sent each open
        assert servicer.seen.seen("gw-1") == 40  # the caller's calls, as its Generate calls would be
        writes = metrics.registry.get_sample_value(
            "tts_session_write_seconds_count", {"service": "talker", "method": f"/{SERVICE}/Session"}
        )
        assert writes >= 1  # the audio's messages to the gateway, each write timed
        await session.close()


async def test_a_failed_stream_ends_with_its_generate_status_and_the_others_go_on():
    async with talker() as (_, _servicer, _behaviour, metrics, channel):
        session = await ready(TalkerSession(channel))
        fine = asyncio.ensure_future(collect(session, "fine", "ok:30"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(session, "r1", "refuse")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == "the talker is at capacity"
        trailing = dict(refused.value.trailing_metadata())
        assert trailing["retry-after"] == "3" and 3000 <= int(trailing["retry-after-ms"]) < 4500
        error = from_grpc(refused.value.code(), refused.value.details(), refused.value.trailing_metadata())
        assert isinstance(error, ResourceExhausted) and error.retry_after_s == 3

        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await collect(session, "r2", "invalid")
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = dict(invalid.value.trailing_metadata())["grpc-status-details-bin"]
        assert isinstance(details, bytes) and b"voice" in details  # the BadRequest naming the field

        with pytest.raises(grpc.aio.AioRpcError) as crash:
            await collect(session, "r3", "crash")
        assert crash.value.code() == grpc.StatusCode.INTERNAL and crash.value.details() == "internal error"

        assert len(await fine) == 31  # the session and its other stream carried on
        assert calls(metrics, GENERATE, "RESOURCE_EXHAUSTED") == 1
        assert calls(metrics, GENERATE, "INVALID_ARGUMENT") == 1
        assert calls(metrics, GENERATE, "INTERNAL") == 1
        errors = metrics.registry.get_sample_value(
            "tts_errors_total", {"service": "talker", "code": "INTERNAL"}
        )
        assert errors == 1
        await session.close()


async def test_closing_a_stream_cancels_its_work_and_leaves_the_session_open(eventually):
    async with talker() as (_, servicer, behaviour, metrics, channel):
        session = await ready(TalkerSession(channel))
        stream = stream_on(session, "gone", "endless")
        assert (await anext(stream)).audio.num_frames == 1
        await stream.aclose()  # the listener went away
        await eventually(lambda: behaviour.cancelled == ["gone"], what="the talker's stream cancelled")
        await eventually(lambda: calls(metrics, GENERATE, "CANCELLED") == 1)
        assert len(await collect(session, "next", "ok:3")) == 4  # the same call goes on
        assert calls(metrics, f"/{SERVICE}/Session", "CANCELLED") == 0
        await session.close()

        # Any end first, then which: a failure says what the Session call ended with, if at all.
        def ended() -> dict[str, float]:
            return {
                c.name: n for c in grpc.StatusCode if (n := calls(metrics, f"/{SERVICE}/Session", c.name))
            }

        await eventually(ended, what="the Session call's end counted")
        assert ended() == {"CANCELLED": 1}


async def test_closing_the_session_cancels_every_stream_on_it(eventually):
    async with talker() as (_, _servicer, behaviour, _metrics, channel):
        session = await ready(TalkerSession(channel))
        streams = [stream_on(session, f"e{i}", "endless") for i in range(3)]
        for s in streams:
            await anext(s)
        await session.close()  # the gateway went away
        await eventually(
            lambda: sorted(behaviour.cancelled) == ["e0", "e1", "e2"], what="every stream cancelled"
        )
        for s in streams:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    await anext(s)
            assert err.value.code() == grpc.StatusCode.CANCELLED


async def test_a_draining_talker_refuses_new_opens_and_ends_the_session_after_its_streams(eventually):
    async with talker() as (host, _servicer, _behaviour, metrics, channel):
        session = await ready(TalkerSession(channel))
        running = stream_on(session, "long", "slow:100")
        await anext(running)
        stop = asyncio.ensure_future(host.stop(5.0))
        await eventually(lambda: host._stopped)
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(session, "late", "ok:1")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        rest = [m async for m in running]  # the running stream finishes whole
        assert rest[-1].WhichOneof("event") == "summary" and len(rest) == 100
        await asyncio.wait_for(stop, 5)  # and the session ended with it, well inside the grace
        assert calls(metrics, f"/{SERVICE}/Session", "OK") == 1


async def test_a_lost_talker_fails_the_streams_on_its_session():
    async with talker() as (host, _servicer, _behaviour, _metrics, channel):
        session = await ready(TalkerSession(channel))
        stream = stream_on(session, "e", "endless")
        await anext(stream)
        await host.stop(0)  # no grace: the call is cut
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await anext(stream)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Older(talker_pb2_grpc.TalkerServiceServicer):
    """A talker from before Session: the generated base answers it."""


async def test_a_talker_without_session_is_answered_unimplemented_and_not_asked_again(eventually):
    async with talker(Older) as (_, _servicer, _behaviour, metrics, channel):
        session = TalkerSession(channel)
        assert session.open(request("r", "ok:1"), ()) is None  # no call has answered: a call of its own
        await eventually(lambda: session.unimplemented, what="UNIMPLEMENTED")  # not INTERNAL
        assert session.open(request("r", "ok:1"), ()) is None
        await asyncio.sleep(0.05)
        assert calls(metrics, f"/{SERVICE}/Session", "UNIMPLEMENTED") == 1  # asked once


async def test_calls_rotate_after_rotate_s_and_end_with_their_streams(eventually):
    now = [0.0]
    async with talker() as (_, _servicer, _behaviour, metrics, channel):
        session = await ready(TalkerSession(channel, rotate_s=10.0, clock=lambda: now[0]))
        first_call = session._calls.current()
        a = stream_on(session, "a", "slow:50")
        await anext(a)
        now[0] = 11.0  # past rotate_s: the next call opens; the first takes streams until it answers
        b = stream_on(session, "b", "ok:2")
        await eventually(lambda: session._calls.current() is not first_call, what="the next call in use")
        assert len(await collect(session, "c", "ok:2")) == 3  # on the new call
        assert len([m async for m in b]) == 3
        assert calls(metrics, f"/{SERVICE}/Session", "OK") == 0  # the first still carries "a"
        assert len([m async for m in a]) == 50
        # Half-closed when the new call came into use, it ends with "a".
        await eventually(lambda: calls(metrics, f"/{SERVICE}/Session", "OK") == 1)
        await session.close()


async def test_opens_of_one_turn_go_in_one_message():
    sent: list[talker_pb2.SessionRequest] = []

    class Recording(Servicer):
        async def Session(self, request_iterator, context):  # noqa: N802 - gRPC method name
            async def recorded():
                async for msg in request_iterator:
                    sent.append(msg)
                    yield msg

            async with contextlib.aclosing(self.sessions.serve(recorded())) as msgs:
                async for msg in msgs:
                    yield msg

    async with talker(Recording) as (_, _servicer, behaviour, _metrics, channel):
        session = await ready(TalkerSession(channel))
        await asyncio.gather(*(collect(session, f"r{i}", "ok:1") for i in range(20)))
        assert len(sent[0].open) == 20  # one message carried the turn's opens
        assert sorted(behaviour.started) == sorted(f"r{i}" for i in range(20))
        await session.close()


async def test_the_gateway_client_keeps_a_session_per_channel_and_drops_ended_ones():
    from services.gateway.talker_client import TalkerClient

    async with talker() as (host, _servicer, _behaviour, _metrics, channel):
        client = TalkerClient(f"127.0.0.1:{host.bound_port}")
        try:
            first = client._session(channel)
            assert client._session(channel) is first  # one per channel
            await ready(first)
            assert len(await collect(first, "a", "ok:1")) == 2
            assert not first.idle  # its call stays open for the next request
            await first.close()  # its talker went away: the pool closed the channel
            assert first.idle
            async with grpc.aio.insecure_channel(f"127.0.0.1:{host.bound_port}") as other:
                assert client._session(other) is not first
                assert list(client._sessions) == [other]  # the ended one went
        finally:
            await client.close()


async def test_sessions_off_the_gateway_client_makes_generate_calls():
    from services.gateway.talker_client import TalkerClient

    client = TalkerClient("127.0.0.1:1", sessions=False)
    try:
        assert client._session(client.channel) is None
    finally:
        await client.close()


async def test_text_that_follows_is_appended_in_order_on_the_session():
    async with talker() as (_, _servicer, _behaviour, metrics, channel):
        session = await ready(TalkerSession(channel))
        pieces = asyncio.Queue()

        async def text():
            while (item := await pieces.get()) is not None:
                yield item

        stream = stream_on(session, "t", "Hello", appended=text())
        assert (await anext(stream)).audio.audio == b"Hello"  # the first piece came with the open
        for piece in (" there,", " how"):
            await pieces.put((piece, False))
            assert (await anext(stream)).audio.audio == piece.encode()
        await pieces.put((" are you?", True))
        last = await anext(stream)
        assert last.audio.audio == b" are you?" and last.audio.num_frames == 1  # final
        assert (await anext(stream)).WhichOneof("event") == "summary"
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        # Text that ends without a final piece is completed (as GenerateStream's end of requests).
        short = stream_on(session, "u", "One", appended=aiter_of([("two", False)]))
        got = [m async for m in short]
        assert [m.audio.audio for m in got[:-1]] == [b"One", b"two", b""] and got[-2].audio.num_frames == 1
        assert (
            calls(metrics, GENERATE_STREAM, "OK") == 2
        )  # counted as the GenerateStream calls they stand for
        assert calls(metrics, GENERATE, "OK") == 0
        await session.close()


async def aiter_of(items):
    for item in items:
        yield item


class WithGenerateStream(Servicer):
    """Also serves GenerateStream, recording each call."""

    def __init__(self, behaviour, metrics):
        super().__init__(behaviour, metrics)
        self.stream_calls: list[str] = []

    async def GenerateStream(self, request_iterator, context):  # noqa: N802 - gRPC method name
        first = await anext(aiter(request_iterator))
        self.stream_calls.append(first.start.request_id)
        async for _ in request_iterator:
            pass
        yield talker_pb2.GenerateStreamResponse(
            request_id=first.start.request_id, summary=talker_pb2.GenerateSummary()
        )


async def test_the_gateway_client_sends_text_on_a_session_once_it_has_answered(eventually):
    from services.gateway.talker_client import TalkerClient
    from tests.synthesis_jobs import talker_job

    async with talker(WithGenerateStream) as (host, servicer, behaviour, _metrics, _channel):
        client = TalkerClient(f"127.0.0.1:{host.bound_port}")
        try:
            # No session call has answered yet: a text stream is a GenerateStream call of its own.
            got = [x async for x in client.generate(talker_job("s1"), aiter_of([("more", True)]))]
            assert servicer.stream_calls == ["s1"] and "s1" not in behaviour.started
            assert got[-1].num_frames == 0  # its summary
            session = client._session(client.channel)
            await eventually(lambda: session._calls.current() is not None, what="the session answered")
            got = [x async for x in client.generate(talker_job("s2"), aiter_of([(" more", True)]))]
            assert servicer.stream_calls == ["s1"] and "s2" in behaviour.started  # on the session
            assert [bytes(x.pcm_s16le) for x in got[:-1]] == [b"Hi.", b" more"]
            [x async for x in client.generate(talker_job("p1", text="ok:1"))]
            assert "p1" in behaviour.started
        finally:
            await client.close()
