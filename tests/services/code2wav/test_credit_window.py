"""Credit window: a stalled consumer (no acks) or a stalled decoder bounds what the producer may send."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from qtts.pb import code2wav_pb2 as pb
from qtts.pb import code2wav_pb2_grpc
from qtts.request.errors import FailedPrecondition
from qtts.serving.metrics import Code2WavMetrics
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import Credit, DecodedAudio
from services.code2wav.config import Code2WavConfig
from services.code2wav.credit import CreditPolicy
from services.code2wav.server import Code2WavServer
from services.code2wav.stream import CodecShape, DecodeStream

SPF = 1920


def _codes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, (n, 16)).astype(np.int16)


# ---------------------------------------------------------------------------- the policy alone


def test_policy_is_the_minimum_of_decode_window_and_listener_lead():
    policy = CreditPolicy(window_frames=8, max_ahead_frames=12)
    assert policy.frames_allowed_until(decoded_frames=0, acked_frames=0) == 8
    assert policy.frames_allowed_until(decoded_frames=2, acked_frames=0) == 10
    # No acks: however far decoding gets, the producer stops at max_ahead.
    assert [policy.frames_allowed_until(d, 0) for d in (4, 8, 12, 100)] == [12, 12, 12, 12]
    assert policy.frames_allowed_until(decoded_frames=12, acked_frames=6) == 18
    # A slow decoder bounds the backlog even when the listener is far ahead.
    assert policy.frames_allowed_until(decoded_frames=3, acked_frames=3) == 11
    assert policy.max_chunk_frames() == 8
    with pytest.raises(ValueError):
        CreditPolicy(0, 10)


def _stream(policy: CreditPolicy) -> DecodeStream:
    stream = DecodeStream("r", ChunkPlan(2, (4,)), policy, CodecShape(), Code2WavMetrics(CollectorRegistry()))
    stream.decoder_state = object()
    stream.start_credit()
    return stream


def _drain(stream: DecodeStream) -> list:
    out = []
    while not stream._outbox.empty():
        out.append(stream._outbox.get_nowait())
    return out


def _decode_ready(stream: DecodeStream) -> None:
    while stream.ready_frames():
        first, codes = stream.take_chunk()
        n = codes.shape[0]
        stream.deliver(DecodedAudio(b"\0\0" * n * SPF, n * SPF, first, n, 0))


def test_stream_without_acks_stops_at_max_ahead_and_acks_reopen_it():
    stream = _stream(CreditPolicy(window_frames=8, max_ahead_frames=12))
    # The first grant carries the chunk plan, so the producer can send a chunk at a time.
    first = _drain(stream)
    assert first == [Credit(8, ChunkPlan(2, (4,)), cuts_at_flush=True)]  # the plan, and the flush cut
    assert [first[0].plan.end_after(n) for n in (0, 1, 2, 5, 6, 10)] == [2, 2, 6, 6, 10, 14]
    assert Credit(8).plan is None
    sent = 0
    for _ in range(10):  # a producer that sends whatever it is granted, a decoder that keeps up
        stream.add_frames(sent, _codes(stream.granted - sent))
        sent = stream.granted
        _decode_ready(stream)
        if stream.granted == sent:
            break
    assert sent == 12 and stream.granted == 12
    grants = [e.frames_allowed_until for e in _drain(stream) if isinstance(e, Credit)]
    assert grants == sorted(set(grants)) and grants[-1] == 12
    with pytest.raises(FailedPrecondition, match="credit allows only up to 12"):
        stream.add_frames(12, _codes(1))
    stream.ack(4 * SPF)
    assert _drain(stream) == [Credit(16)]
    stream.ack(4 * SPF)  # a repeated ack does not move the grant: nothing is sent
    assert _drain(stream) == []


def test_undecoded_backlog_is_bounded_by_the_window():
    stream = _stream(CreditPolicy(window_frames=8, max_ahead_frames=100))
    stream.add_frames(0, _codes(8))
    assert stream.received_frames - stream.decoded_frames == 8
    with pytest.raises(FailedPrecondition):
        stream.add_frames(8, _codes(1))
    _decode_ready(stream)  # 2 + 4 frames decoded, 2 pending (short of a 4-frame chunk)
    assert stream.decoded_frames == 6 and stream.granted == 14


# ---------------------------------------------------------------------------- through the server


async def test_stalled_consumer_bounds_the_producer_through_the_server(fake_decoder, bidi_client):
    config = Code2WavConfig(
        port=0,
        metrics_port=0,
        drain_seconds=0.5,
        first_chunk_frames=2,
        chunk_frames_ramp=(4,),
        credit_window_frames=8,
        max_ahead_frames=12,
    ).validate()
    server = Code2WavServer(config, decoder=fake_decoder)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        client = bidi_client(code2wav_pb2_grpc.Code2WavServiceStub(channel).Decode)
        client.send(pb.DecodeRequest(start=pb.StreamStart(request_id="slow-reader", num_codebooks=16)))
        codes = _codes(100)
        sent, audio_frames, grants = 0, 0, []
        # The consumer never acks: keep sending all the credit allows. Chunks of 2, 4, 4 frames get
        # decoded; the last 2 frames wait for a full chunk (or StreamEnd).
        while not (sent == 12 and audio_frames == 10):
            msg = await client.read()
            kind = msg.WhichOneof("event")
            if kind == "credit":
                grants.append(msg.credit.frames_allowed_until)
                n = msg.credit.frames_allowed_until - sent
                client.send(
                    pb.DecodeRequest(
                        frames=pb.FrameDelta(
                            first_frame_index=sent, num_frames=n, codes_i16=codes[sent : sent + n].tobytes()
                        )
                    )
                )
                sent += n
            elif kind == "audio":
                audio_frames += msg.audio.num_frames
        # Nothing was acked: the grant stopped at max_ahead although the decoder had room.
        assert grants[-1] == 12 and max(grants) == 12
        stream = next(iter(server.engine.registry))
        # The last delta went out after the last grant; the audio before it can arrive first.
        for _ in range(500):
            if stream.received_frames == 12:
                break
            await asyncio.sleep(0.01)
        assert stream.granted == 12 and stream.received_frames == 12

        # The listener takes 4 frames of audio: exactly 4 more frames may be sent.
        client.send(pb.DecodeRequest(ack=pb.AudioAck(samples_delivered=4 * SPF)))
        msg = await client.read()
        while msg.WhichOneof("event") == "credit" and msg.credit.frames_allowed_until == 12:
            msg = await client.read()  # a grant of the old bound that was on its way
        assert msg.WhichOneof("event") == "credit" and msg.credit.frames_allowed_until == 16

        # Sending beyond the credit ends the stream (and frees it).
        client.send(
            pb.DecodeRequest(
                frames=pb.FrameDelta(first_frame_index=12, num_frames=5, codes_i16=codes[12:17].tobytes())
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await client.read() is not None:
                pass
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        from tests.grpc_helpers import wait_until

        await wait_until(
            lambda: len(server.engine.registry) == 0 and fake_decoder.live == 0, what="state freed"
        )
    finally:
        await channel.close()
        await server.stop(0.5)


async def test_stalled_decoder_bounds_the_backlog_through_the_server(fake_decoder, bidi_client):
    from tests.grpc_helpers import wait_until

    config = Code2WavConfig(
        port=0, metrics_port=0, drain_seconds=0.5, credit_window_frames=32, first_chunk_frames=2
    ).validate()
    server = Code2WavServer(config, decoder=fake_decoder)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        client = bidi_client(code2wav_pb2_grpc.Code2WavServiceStub(channel).Decode)
        client.send(pb.DecodeRequest(start=pb.StreamStart(request_id="r", num_codebooks=16)))
        msg = await client.read()
        assert msg.credit.frames_allowed_until == 32
        fake_decoder.gate.clear()  # the decoder stalls
        codes = _codes(32)
        client.send(
            pb.DecodeRequest(
                frames=pb.FrameDelta(first_frame_index=0, num_frames=32, codes_i16=codes.tobytes())
            )
        )
        await wait_until(
            lambda: server.metrics.registry.get_sample_value("tts_code2wav_decode_backlog_frames") == 32
        )
        stream = next(iter(server.engine.registry))
        assert stream.granted == 32  # no grant moved while nothing was decoded
        fake_decoder.gate.set()
        msg = await client.read()
        while msg.WhichOneof("event") != "credit":
            msg = await client.read()
        assert msg.credit.frames_allowed_until == 34  # first chunk (2 frames) decoded -> window moves by 2
        client.call.cancel()
        await wait_until(
            lambda: len(server.engine.registry) == 0 and fake_decoder.live == 0, what="state freed"
        )
        assert server.metrics.registry.get_sample_value("tts_code2wav_decode_backlog_frames") == 0
    finally:
        fake_decoder.gate.set()
        await channel.close()
        await server.stop(0.5)
