"""`code2wav.v1.Code2WavService/DecodeSession`: many Decode streams on one call per replica, the
replica's end (services/code2wav/session.py) and the talker's (services/talker/decode_session.py)
through a real code2wav server. Each stream behaves as its Decode call would: the same audio and
grants, the same statuses, a cancel that frees its decoder state."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from qtts.pb import code2wav_pb2_grpc
from qtts.request.errors import ResourceExhausted
from services.talker import code2wav_client as c2w
from services.talker.decode_session import ReplicaSession, SessionDecodeCall
from services.talker.replicas import Code2WavReplicas
from tests.services.code2wav.test_code2wav import SPF, TEST_PLAN, _codes, code2wav


async def ready_session(stub, eventually, on_written=None) -> ReplicaSession:
    session = ReplicaSession(stub, on_written=on_written)
    assert session.open("replica-a", None) is None  # opens the call; nothing has answered yet
    await eventually(lambda: session._calls.current() is not None, what="the replica's first message")
    return session


def on(session: ReplicaSession) -> SessionDecodeCall:
    call = session.open("replica-a", None)
    assert call is not None
    return call


async def drive(call: SessionDecodeCall, codes: np.ndarray, request_id: str) -> tuple[list, c2w.Done]:
    """A well-behaved talker: frames within credit, an ack per chunk, the end; returns the audio."""
    await call.start(request_id, 16, None, TEST_PLAN.first, TEST_PLAN.ramp)
    sent, allowed, audio = 0, 0, []
    async for ev in call.events():
        if isinstance(ev, c2w.Credit):
            allowed = ev.frames_allowed_until
        elif isinstance(ev, c2w.DecodedAudio):
            audio.append(ev)
            await call.ack(sum(a.num_samples for a in audio))
        elif isinstance(ev, c2w.Done):
            return audio, ev
        else:
            raise AssertionError(f"unexpected {ev}")
        if sent < len(codes) and allowed > sent:
            n = min(allowed, len(codes)) - sent
            await call.send_frames(sent, codes[sent : sent + n])
            sent += n
            if sent == len(codes):
                await call.end(sent)
    raise AssertionError("no StreamDone")


async def test_streams_on_one_session_get_what_their_decode_calls_would(fake_decoder, eventually):
    async with code2wav(fake_decoder) as (server, stub):
        written: list[float] = []
        session = await ready_session(stub, eventually, written.append)
        codes = [_codes(20 + 7 * i, seed=i) for i in range(12)]
        results = await asyncio.gather(*(drive(on(session), c, f"r{i}") for i, c in enumerate(codes)))
        for c, (audio, done) in zip(codes, results, strict=True):
            assert done.num_frames == len(c) and done.replica == "replica-a"
            pcm = np.frombuffer(b"".join(a.pcm_s16le for a in audio), dtype="<i2")
            expected = (fake_decoder.expected(c, 0).clamp(-1, 1) * 32767).round().short().numpy()
            np.testing.assert_array_equal(pcm, expected)
            assert sum(a.num_samples for a in audio) == len(c) * SPF
        reg = server.metrics.registry
        labels = {"service": "code2wav", "method": "/code2wav.v1.Code2WavService/Decode", "code": "OK"}
        await eventually(lambda: reg.get_sample_value("tts_rpc_requests_total", labels) == 12)
        await eventually(lambda: reg.get_sample_value("tts_code2wav_live_states") == 0)
        await asyncio.sleep(0.05)
        # The acks of the last chunks (after StreamEnd) are not sent: one for a stream the replica
        # had closed would have started a stream there, failed as "the first message must be
        # StreamStart".
        errors = reg.get_sample_value(
            "tts_errors_total", {"service": "code2wav", "code": "FAILED_PRECONDITION"}
        )
        assert not errors
        # Each message's write is timed on both sides (the part of the hop a session hides).
        assert written and all(0 <= s < 5 for s in written)  # starts, frames, acks, ends
        session_labels = {"service": "code2wav", "method": "/code2wav.v1.Code2WavService/DecodeSession"}
        assert reg.get_sample_value("tts_session_write_seconds_count", session_labels) >= 1
        # Each stream's messages waited on the replica from their read off the call to the stream
        # taking them (a start, frames and an end at least per stream), and each chunk's audio was
        # stamped as the talker read it off the call.
        assert reg.get_sample_value("tts_code2wav_session_message_wait_seconds_count") >= 12 * 3
        assert 0 <= reg.get_sample_value("tts_code2wav_session_message_wait_seconds_sum") < 12 * 3 * 5
        assert all(0 < a.received_at <= time.perf_counter() for audio, _ in results for a in audio)
        await session.close()


async def test_a_protocol_violation_ends_that_stream_only(fake_decoder, eventually):
    async with code2wav(fake_decoder) as (server, stub):
        session = await ready_session(stub, eventually)
        fine = asyncio.ensure_future(drive(on(session), _codes(30), "fine"))
        bad = on(session)
        await bad.send_frames(0, _codes(2))  # frames before StreamStart
        events = [ev async for ev in bad.events()]
        assert len(events) == 1 and isinstance(events[0], c2w.DecodeFailed)
        assert not events[0].replica_down and "StreamStart" in events[0].error.message
        # Frames that were in flight for it when it failed are dropped, not a stream of their own.
        bad._session.send(bad._sid, c2w.frames_request(2, _codes(2)))
        audio, done = await fine
        assert done.num_frames == 30
        await asyncio.sleep(0.05)
        reg = server.metrics.registry
        failed = {"service": "code2wav", "code": "FAILED_PRECONDITION"}
        assert reg.get_sample_value("tts_errors_total", failed) == 1
        await session.close()


async def test_a_cancelled_stream_frees_its_decoder_state(fake_decoder, eventually):
    async with code2wav(fake_decoder) as (server, stub):
        session = await ready_session(stub, eventually)
        call = on(session)
        await call.start("gone", 16, None, TEST_PLAN.first, TEST_PLAN.ramp)
        events = call.events()
        assert isinstance(await anext(events), c2w.Credit)
        reg = server.metrics.registry
        await eventually(lambda: reg.get_sample_value("tts_code2wav_live_states") == 1)
        call.cancel()  # the talker's stream ended early
        await events.aclose()
        await eventually(lambda: reg.get_sample_value("tts_code2wav_live_states") == 0, what="state freed")
        # The session carries the next stream.
        audio, done = await drive(on(session), _codes(10), "next")
        assert done.num_frames == 10
        await session.close()


async def test_a_replica_that_goes_away_fails_its_streams_as_down(fake_decoder, eventually):
    async with code2wav(fake_decoder) as (server, stub):
        session = await ready_session(stub, eventually)
        call = on(session)
        await call.start("s", 16, None, TEST_PLAN.first, TEST_PLAN.ramp)
        events = call.events()
        assert isinstance(await anext(events), c2w.Credit)
        await server.stop(0)
        last = [ev async for ev in events][-1]
        assert isinstance(last, c2w.DecodeFailed) and last.replica_down  # the stream fails over
        assert session.open("replica-a", None) is None  # a Decode call meanwhile; a new one opens
        await session.close()


class WithoutSession(code2wav_pb2_grpc.Code2WavServiceServicer):
    """A replica from before DecodeSession."""


async def test_a_replica_without_sessions_keeps_getting_decode_calls(eventually):
    from qtts.serving.grpc_server import GrpcServiceHost

    host = GrpcServiceHost(service_names=["code2wav.v1.Code2WavService"])
    code2wav_pb2_grpc.add_Code2WavServiceServicer_to_server(WithoutSession(), host.server)
    port = await host.start()
    replicas = Code2WavReplicas([f"127.0.0.1:{port}"])
    try:
        address = replicas.addresses[0]
        assert isinstance(replicas.open_call(address), c2w.DecodeCall)
        session = replicas._sessions[address]
        await eventually(lambda: session.unimplemented, what="UNIMPLEMENTED")
        assert isinstance(replicas.open_call(address), c2w.DecodeCall)
    finally:
        await replicas.close()
        await host.stop(0)


async def test_the_replicas_put_streams_on_the_session_once_it_answered(fake_decoder, eventually):
    async with code2wav(fake_decoder) as (server, _stub):
        replicas = Code2WavReplicas([f"127.0.0.1:{server.host.bound_port}"])
        try:
            address = replicas.addresses[0]
            first = replicas.open_call(address)
            assert isinstance(first, c2w.DecodeCall)  # the session's call is opening meanwhile
            first.cancel()
            await eventually(lambda: replicas._sessions[address]._calls.current() is not None)
            call = replicas.open_call(address)
            assert isinstance(call, SessionDecodeCall)
            audio, done = await drive(call, _codes(12), "s")
            assert done.num_frames == 12
        finally:
            await replicas.close()


async def test_sessions_off_the_replicas_make_decode_calls():
    replicas = Code2WavReplicas(["127.0.0.1:1"], sessions=False)
    try:
        assert isinstance(replicas.open_call(replicas.addresses[0]), c2w.DecodeCall)
        assert replicas._sessions == {}
    finally:
        await replicas.close()


async def test_grpc_status_codes_map_back(fake_decoder, eventually):
    """A stream refused at the replica's state bound ends RESOURCE_EXHAUSTED, not as a dead replica."""
    async with code2wav(fake_decoder, max_states=1) as (_, stub):
        session = await ready_session(stub, eventually)
        held = on(session)
        await held.start("held", 16, None, TEST_PLAN.first, TEST_PLAN.ramp)
        held_events = held.events()
        assert isinstance(await anext(held_events), c2w.Credit)
        refused = on(session)
        await refused.start("refused", 16, None, TEST_PLAN.first, TEST_PLAN.ramp)
        events = [ev async for ev in refused.events()]
        assert isinstance(events[-1], c2w.DecodeFailed) and not events[-1].replica_down
        assert isinstance(events[-1].error, ResourceExhausted)  # the replica's own status, mapped back
        held.cancel()
        await held_events.aclose()
        await session.close()
