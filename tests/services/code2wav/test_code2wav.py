"""code2wav: chunk planner, state registry, and the Decode stream through a real gRPC server."""

from __future__ import annotations

import itertools
from contextlib import asynccontextmanager

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from qtts.pb import code2wav_pb2 as pb
from qtts.pb import code2wav_pb2_grpc
from qtts.request.errors import InvalidArgument, ResourceExhausted
from qtts.serving.metrics import Code2WavMetrics
from qtts.streams.chunk_plan import STEADY_CHUNK_RAMP as STEADY_RAMP
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import Credit, DecodedAudio
from services.code2wav.config import Code2WavConfig, config_from_args
from services.code2wav.credit import CreditPolicy
from services.code2wav.registry import StreamRegistry
from services.code2wav.server import SERVICE_NAME, Code2WavServer
from services.code2wav.servicer import event_to_pb
from services.code2wav.stream import CodecShape, DecodeStream

SPF = 1920


def _codes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2048, (n, 16)).astype(np.int16)


TEST_PLAN = ChunkPlan(2, (2, 4, 8, 16))


def _start(request_id: str = "r", prefix: np.ndarray | None = None, nc: int = 16, **kw) -> pb.DecodeRequest:
    start = pb.StreamStart(request_id=request_id, num_codebooks=nc, **kw)
    if prefix is not None:
        start.prefix_codes_i16 = prefix.astype("<i2").tobytes()
        start.num_prefix_frames = prefix.shape[0]
    return pb.DecodeRequest(start=start)


def _frames(first: int, codes: np.ndarray) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        frames=pb.FrameDelta(
            first_frame_index=first, num_frames=codes.shape[0], codes_i16=codes.astype("<i2").tobytes()
        )
    )


def _end(total: int) -> pb.DecodeRequest:
    return pb.DecodeRequest(end=pb.StreamEnd(total_frames=total))


def _ack(samples: int) -> pb.DecodeRequest:
    return pb.DecodeRequest(ack=pb.AudioAck(samples_delivered=samples))


@asynccontextmanager
async def code2wav(decoder, codec_shape: CodecShape | None = None, **overrides):
    # A plan of 2-frame chunks first, so that the protocol tests' 2-frame deltas decode at once.
    overrides.setdefault("first_chunk_frames", TEST_PLAN.first)
    overrides.setdefault("chunk_frames_ramp", TEST_PLAN.ramp)
    config = Code2WavConfig(port=0, metrics_port=0, drain_seconds=0.5, replica_name="replica-a", **overrides)
    server = Code2WavServer(config.validate(), decoder=decoder, codec_shape=codec_shape)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield server, code2wav_pb2_grpc.Code2WavServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(0.5)


async def run_stream(
    bidi_client, stub, codes: np.ndarray, prefix=None, delta: int = 3, client=None, **start_kw
):
    """A well-behaved producer: sends within credit, acks every chunk, ends; returns what came back.

    With `client`, the stream was started already and its first message is still to be read.
    """
    if client is None:
        client = bidi_client(stub.Decode)
        client.send(_start(prefix=prefix, **start_kw))
    sent, chunks, grants, done, stream_ids = 0, [], [], None, set()
    total = codes.shape[0]
    if total == 0:
        client.send(_end(0))
    while (msg := await client.read()) is not None:
        stream_ids.add(msg.stream_id)
        kind = msg.WhichOneof("event")
        if kind == "credit":
            grants.append(msg.credit.frames_allowed_until)
            limit = min(msg.credit.frames_allowed_until, total)
            while sent < limit:
                n = min(delta, limit - sent)
                client.send(_frames(sent, codes[sent : sent + n]))
                sent += n
            if sent == total and total > 0 and grants[-1] >= total and not getattr(client, "ended", False):
                client.ended = True
                client.send(_end(total))
        elif kind == "audio":
            chunks.append(msg.audio)
            client.send(_ack(sum(c.num_samples for c in chunks)))
        elif kind == "done":
            done = msg.done
            client.close_requests()  # half-close after StreamDone, as the protocol asks
    assert len(stream_ids) == 1
    return chunks, done, grants


# ---------------------------------------------------------------------------- pure units


def test_chunk_planner_default_ramp_repeats_last_value():
    plan = ChunkPlan()
    # One frame first (the prefill step makes it), then a ramp that ends in a captured size.
    assert [plan.size(i) for i in range(11)] == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 16]
    assert plan.split(3) == [1, 1, 1]
    assert plan.split(40) == [1, 1, 2, 2, 4, 4, 8, 8, 10]
    assert sum(plan.split(1000)) == 1000
    assert plan.split(0) == []
    assert ChunkPlan(1, (3,)).split(7) == [1, 3, 3]
    assert plan.capped(8).split(40) == [1, 1, 2, 2, 4, 4, 8, 8, 8, 2]
    assert ChunkPlan.from_request(0, [], plan) == plan
    assert ChunkPlan.from_request(2, [], plan) == ChunkPlan(2, plan.ramp)


def test_default_ramp_keeps_every_chunk_ahead_of_its_listener():
    """No chunk of the default plan needs its frames more than 1.5x faster than real time, no
    more than the 4-frame start needed; a plan that doubles each chunk needs 2x."""
    assert ChunkPlan().first <= 2
    assert ChunkPlan().required_speedup() <= 1.5
    assert ChunkPlan(4, (4, 4, 8, 8, 16)).required_speedup() == pytest.approx(40 / 28)
    assert ChunkPlan(1, (2, 4, 8, 12)).required_speedup() == 2.0
    assert ChunkPlan(4, (2,)).required_speedup() == 1.0  # never below real time


def test_required_speedup_matches_a_listener_fed_at_that_rate():
    """At exactly `required_speedup` the frames of every chunk are made by the time the audio
    before it has played; a little slower and some chunk is late."""
    for plan in (ChunkPlan(), ChunkPlan(2, (4, 4, 8, 16, 25)), ChunkPlan(1, (1, 3, 9))):
        speed = plan.required_speedup()
        for factor, on_time in ((1.0, True), (0.97, False)):
            made_per_s = speed * factor / 0.08  # frames a second
            ends = list(itertools.accumulate(plan.split(400)))
            start = ends[0] / made_per_s  # playback starts with the first chunk
            late = [
                end / made_per_s - start > prev * 0.08 + 1e-9
                for prev, end in zip(ends, ends[1:], strict=False)
            ]
            assert (not any(late)) is on_time, (plan, factor)


def test_chunk_boundaries_match_split():
    """end_after / end_at_or_below (the talker's batching) agree with the cumulative split."""
    for plan in (ChunkPlan(), ChunkPlan(1, (3,)), ChunkPlan(2, (4, 4, 8)), ChunkPlan(5, (2, 7))):
        ends = [0]
        for size in plan.split(500):
            ends.append(ends[-1] + size)
        for frames in range(0, 400):
            assert plan.end_after(frames) == min(e for e in ends if e > frames)
            assert plan.end_at_or_below(frames) == max(e for e in ends if e <= frames)
    assert ChunkPlan.from_request(1, [5], plan) == ChunkPlan(1, (5,))
    with pytest.raises(ValueError):
        ChunkPlan(0, (4,))
    with pytest.raises(ValueError):
        ChunkPlan(2, ())


def _boundaries(plan: ChunkPlan, upto: int) -> list[int]:
    """The plan's chunk ends from its start up to `upto`, chunk by chunk (`size`)."""
    ends, end, k = [], plan.start, 0
    while end < upto:
        end += plan.size(k)
        k += 1
        ends.append(end)
    return ends


def test_a_flush_cuts_a_chunk_and_the_plan_goes_on_from_there():
    """A flush at frame f (the stream waits for text): the frames since the last boundary are a
    chunk of their own in that chunk's place, and the next chunk, of the size after it, starts
    at f. On a boundary nothing changes; boundaries agree with `end_after` / `end_at_or_below`."""
    plan = ChunkPlan()  # 1, 1, 2, 2, 4, 4, 8, 8, 16...
    assert _boundaries(plan, 30) == [1, 2, 4, 6, 10, 14, 22, 30]
    assert plan.flushed(0) is plan and plan.flushed(6) is plan
    # Cut at 3 inside chunk 2 (frames 2-3): chunk 3 (2 frames) starts at 3, then 4, 4, 8...
    cut = plan.flushed(3)
    assert cut == ChunkPlan(2, (4, 4, 8, 8, 16), start=3)
    assert _boundaries(cut, 40) == [5, 9, 13, 21, 29, 45]
    # Cut again, past the ramp's end: the repeating size goes on.
    again = cut.flushed(50)
    assert again.start == 50 and _boundaries(again, 80) == [66, 82]
    # Before its start a plan has nothing to cut.
    with pytest.raises(ValueError):
        cut.flushed(2)
    for flushed in (cut, again, ChunkPlan(2, (4, 4, 8)).flushed(5), ChunkPlan(5, (2, 7)).flushed(9)):
        ends = _boundaries(flushed, 500)
        for frames in range(flushed.start, 400):
            assert flushed.end_after(frames) == min(e for e in ends if e > frames)
            assert flushed.end_at_or_below(frames) == max([flushed.start, *(e for e in ends if e <= frames)])
    # The start survives the credit's cap, and a plan from a grant (start 0) equals its constant.
    assert cut.capped(2) == ChunkPlan(2, (2, 2, 2, 2, 2), start=3)
    assert ChunkPlan(2, STEADY_RAMP) == ChunkPlan(2, STEADY_RAMP, start=0)


def test_the_first_grant_says_the_replica_cuts_its_chunks_at_a_flush():
    """CreditGrant.cuts_at_flush: a talker flushes only a replica that says so (an older one, in a
    rolling upgrade, would not cut its chunks where the talker cuts its own)."""
    metrics = Code2WavMetrics(CollectorRegistry())
    stream = DecodeStream("r", ChunkPlan(2, (4, 8)), CreditPolicy(window_frames=32), CodecShape(), metrics)
    stream.decoder_state = object()
    stream.start_credit()
    first = stream._outbox.get_nowait()
    assert first.plan == ChunkPlan(2, (4, 8)) and first.cuts_at_flush
    msg = event_to_pb("s", 0, first)
    assert msg.credit.cuts_at_flush and msg.credit.first_chunk_frames == 2
    later = event_to_pb("s", 1, Credit(40))
    assert not later.credit.cuts_at_flush and later.credit.first_chunk_frames == 0


def test_a_first_chunks_wait_for_its_decoder_state_is_counted_apart():
    """The first chunk's wait for a decode call (tts_code2wav_first_chunk_wait_seconds) and, of it,
    the part before the stream's decoder state was made: frames that came before the state wait
    for it; a state made before the frames adds nothing; later chunks count in neither."""
    now = [0.0]
    metrics = Code2WavMetrics(CollectorRegistry())
    reg = metrics.registry

    def stream_at(name: str) -> DecodeStream:
        plan, policy = ChunkPlan(2, (4, 8)), CreditPolicy(window_frames=32)
        return DecodeStream(name, plan, policy, CodecShape(), metrics, clock=lambda: now[0])

    early = stream_at("frames-first")
    early.start_credit()
    early.add_frames(0, _codes(2))  # the first chunk is whole at 0 s; no state yet
    assert early.ready_frames() == 0
    now[0] = 0.030
    early.decoder_state = object()  # made at 30 ms
    now[0] = 0.035
    assert early.take_chunk()[1].shape[0] == 2  # decoded at 35 ms
    assert reg.get_sample_value("tts_code2wav_first_chunk_wait_seconds_sum") == pytest.approx(0.035)
    assert reg.get_sample_value("tts_code2wav_first_chunk_state_wait_seconds_sum") == pytest.approx(0.030)

    ready = stream_at("state-first")
    ready.decoder_state = object()  # made at 35 ms, before its frames
    ready.start_credit()
    now[0] = 0.040
    ready.add_frames(0, _codes(2))
    now[0] = 0.044
    ready.take_chunk()
    assert reg.get_sample_value("tts_code2wav_first_chunk_wait_seconds_count") == 2
    assert reg.get_sample_value("tts_code2wav_first_chunk_wait_seconds_sum") == pytest.approx(0.039)
    assert reg.get_sample_value("tts_code2wav_first_chunk_state_wait_seconds_count") == 2
    assert reg.get_sample_value("tts_code2wav_first_chunk_state_wait_seconds_sum") == pytest.approx(0.030)

    # A second chunk counts in neither first-chunk histogram.
    ready.deliver(DecodedAudio(b"\0\0" * 2 * 1920, 2 * 1920, 0, 2, 0))
    ready.add_frames(2, _codes(4))
    ready.take_chunk()
    assert reg.get_sample_value("tts_code2wav_first_chunk_state_wait_seconds_count") == 2
    assert reg.get_sample_value("tts_code2wav_chunk_wait_seconds_count") == 3


def test_a_flushed_delta_is_decoded_though_its_chunk_is_short():
    """code2wav decodes every frame received up to a flushed delta, as a chunk of its own, and
    counts chunks as the talker's `ChunkPlan.flushed` does; frames past the flush wait for their
    chunk as before."""
    metrics = Code2WavMetrics(CollectorRegistry())
    stream = DecodeStream("r", ChunkPlan(2, (4, 8)), CreditPolicy(window_frames=32), CodecShape(), metrics)
    stream.decoder_state = object()
    stream.start_credit()
    taken = []

    def decode_ready() -> None:
        while n := stream.ready_frames():
            first, codes = stream.take_chunk()
            assert codes.shape[0] == n
            taken.append((first, n))
            stream.deliver(DecodedAudio(b"\0\0" * n * 1920, n * 1920, first, n, 0))

    stream.add_frames(0, _codes(1))
    decode_ready()
    assert taken == []  # one frame of a 2-frame chunk: it waits
    stream.add_frames(1, _codes(2), flush=True)  # the talker waits for text at frame 3
    decode_ready()
    assert taken == [(0, 2), (2, 1)]  # the whole first chunk, then the cut one (chunk 1)
    plan = ChunkPlan(2, (4, 8)).flushed(3)
    assert plan.end_after(3) == 11  # chunk 2, 8 frames, from frame 3: the talker's view
    stream.add_frames(3, _codes(7))
    decode_ready()
    assert taken[2:] == []  # 7 of 8 frames: waits for the chunk
    stream.add_frames(10, _codes(1))
    decode_ready()
    assert taken[2:] == [(3, 8)]
    # A flush with frames past an earlier boundary: the full chunk, then the rest up to the flush.
    stream.add_frames(11, _codes(10), flush=True)
    decode_ready()
    assert taken[3:] == [(11, 8), (19, 2)]
    stream.end(21)
    decode_ready()
    assert stream.decoded_frames == 21


def test_registry_rejects_beyond_max_states():
    metrics = Code2WavMetrics(CollectorRegistry())
    registry = StreamRegistry(2, metrics)
    streams = [DecodeStream("r", ChunkPlan(), CreditPolicy(), CodecShape(), metrics) for _ in range(3)]
    registry.add(streams[0])
    registry.add(streams[1])
    with pytest.raises(ResourceExhausted, match="2 live streams"):
        registry.add(streams[2])
    assert metrics.registry.get_sample_value("tts_code2wav_rejected_total") == 1
    assert metrics.registry.get_sample_value("tts_code2wav_live_states") == 2
    registry.remove(streams[0].stream_id)
    registry.add(streams[2])
    assert len(registry) == 2
    assert streams[0].stream_id != streams[1].stream_id


def test_config_rejects_chunks_larger_than_the_credit():
    with pytest.raises(Exception, match="largest chunk"):
        config_from_args(["--credit-window-frames", "8"])  # default ramp ends at 16
    cfg = config_from_args(["--credit-window-frames", "8", "--chunk-frames-ramp", "4,8", "--port", "0"])
    assert cfg.chunk_plan == ChunkPlan(ChunkPlan().first, (4, 8))


# ---------------------------------------------------------------------------- through the server


async def test_stream_returns_chunks_in_order_then_done(fake_decoder, bidi_client):
    codes = _codes(40)
    async with code2wav(fake_decoder) as (server, stub):
        health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(f"127.0.0.1:{server.host.bound_port}"))
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

        chunks, done, grants = await run_stream(bidi_client, stub, codes)
        assert [c.num_frames for c in chunks] == TEST_PLAN.split(40)
        assert [c.first_frame_index for c in chunks] == list(
            np.cumsum([0] + [c.num_frames for c in chunks[:-1]])
        )
        assert all(
            c.num_samples == c.num_frames * SPF and len(c.pcm_s16le) == 2 * c.num_samples for c in chunks
        )
        assert done.num_frames == 40 and done.num_samples == 40 * SPF and done.replica == "replica-a"
        assert grants == sorted(set(grants))  # grants only move forward, and only when they move
        # How long the replica held each chunk (its wait for a call, and the call): at least the
        # call (the two clocks differ, monotonic and perf_counter: a microsecond's leeway).
        assert all(c.held_ns > 0 and c.held_ns >= c.decode_ns - 1_000 for c in chunks)

        pcm = np.frombuffer(b"".join(c.pcm_s16le for c in chunks), dtype="<i2")
        expected = (fake_decoder.expected(codes, 0).clamp(-1, 1) * 32767).round().short().numpy()
        np.testing.assert_array_equal(pcm, expected)

        reg = server.metrics.registry
        assert reg.get_sample_value("tts_code2wav_frames_total") == 40
        calls = reg.get_sample_value("tts_code2wav_decode_seconds_count")
        assert calls >= len(chunks)
        assert reg.get_sample_value("tts_code2wav_decode_batch_streams_count") == calls
        # One stream: one per call; the fake decoder counts no model steps.
        assert reg.get_sample_value("tts_code2wav_decode_batch_streams_sum") == calls
        assert reg.get_sample_value("tts_code2wav_decode_model_steps_count") == 0
        # Every call's frames (the 40, over the calls), and the cost it fits and publishes.
        assert reg.get_sample_value("tts_code2wav_decode_batch_frames_count") == calls
        assert reg.get_sample_value("tts_code2wav_decode_batch_frames_sum") == 40
        est = server.engine.cost.estimate()
        assert reg.get_sample_value("tts_code2wav_decode_cost_seconds", {"cost": "frame"}) == est.frame_s
        assert reg.get_sample_value("tts_code2wav_decode_cost_seconds", {"cost": "call"}) == est.call_s
        # Every chunk's wait for a decode call, and the first chunk's apart (one stream: one).
        assert reg.get_sample_value("tts_code2wav_chunk_wait_seconds_count") == len(chunks)
        assert reg.get_sample_value("tts_code2wav_first_chunk_wait_seconds_count") == 1
        assert reg.get_sample_value("tts_code2wav_live_states") == 0
        assert reg.get_sample_value("tts_code2wav_decode_backlog_frames") == 0
        assert len(server.engine.registry) == 0
        assert fake_decoder.live == 0
        # Start-up phases: the injected decoder loads nothing; the warm-up and SERVING are timed.
        phase = {"service": "code2wav"}
        assert reg.get_sample_value("tts_startup_seconds", {**phase, "phase": "warm up"}) >= 0
        serving = reg.get_sample_value("tts_startup_seconds", {**phase, "phase": "serving"})
        assert serving is not None and serving > 0
        assert (
            reg.get_sample_value(
                "tts_startup_seconds", {**phase, "phase": "load the decoder and capture its graphs"}
            )
            is None
        )


async def test_client_chunk_plan_and_prefix_and_empty_stream(fake_decoder, bidi_client):
    codes, prefix = _codes(9, seed=1), _codes(5, seed=2)
    async with code2wav(fake_decoder) as (server, stub):
        chunks, done, _ = await run_stream(
            bidi_client, stub, codes, prefix=prefix, first_chunk_frames=1, chunk_frames_ramp=[3]
        )
        assert [c.num_frames for c in chunks] == [1, 3, 3, 2]
        pcm = np.frombuffer(b"".join(c.pcm_s16le for c in chunks), dtype="<i2")
        # Audio starts after the prefix: frame positions continue from 5, prefix audio not returned.
        expected = (fake_decoder.expected(codes, 5) * 32767).round().short().numpy()
        np.testing.assert_array_equal(pcm, expected)

        chunks, done, _ = await run_stream(bidi_client, stub, _codes(0))
        assert chunks == [] and done.num_frames == 0
        await _eventually_empty(server, fake_decoder)


async def _eventually_empty(server, decoder):
    from tests.grpc_helpers import wait_until

    await wait_until(lambda: len(server.engine.registry) == 0 and decoder.live == 0, what="states freed")
    assert server.metrics.registry.get_sample_value("tts_code2wav_live_states") == 0
    assert server.metrics.registry.get_sample_value("tts_code2wav_decode_backlog_frames") == 0


async def test_many_streams_are_decoded_in_batches(bidi_client):
    import asyncio

    from tests.grpc_helpers import FakeIncrementalDecoder, wait_until

    decoder = FakeIncrementalDecoder()
    async with code2wav(decoder) as (server, stub):
        # Start all streams first (starting a state also runs on the worker), then hold the worker
        # so that the chunks of several streams pile up while one batch is in flight.
        clients = []
        for i in range(4):
            clients.append(bidi_client(stub.Decode))
            clients[-1].send(_start(f"r{i}"))
        await wait_until(
            lambda: sum(s.started for s in server.engine.registry) == 4, what="4 started streams"
        )
        decoder.gate.clear()
        tasks = [
            asyncio.create_task(run_stream(bidi_client, stub, _codes(12, seed=i), client=c))
            for i, c in enumerate(clients)
        ]

        await wait_until(
            lambda: all(s.received_frames == 12 for s in server.engine.registry), what="all frames received"
        )
        decoder.gate.set()
        results = await asyncio.gather(*tasks)
        for i, (chunks, done, _) in enumerate(results):
            pcm = np.frombuffer(b"".join(c.pcm_s16le for c in chunks), dtype="<i2")
            expected = (decoder.expected(_codes(12, seed=i), 0) * 32767).round().short().numpy()
            np.testing.assert_array_equal(pcm, expected)
            assert done.num_frames == 12
        assert max(decoder.batches) >= 3
        await _eventually_empty(server, decoder)


async def test_max_states_rejects_with_resource_exhausted(fake_decoder, bidi_client):
    async with code2wav(fake_decoder, max_states=1) as (server, stub):
        first = bidi_client(stub.Decode)
        first.send(_start("a"))
        assert (await first.read()).WhichOneof("event") == "credit"

        second = bidi_client(stub.Decode)
        second.send(_start("b"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await second.read()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.metrics.registry.get_sample_value("tts_code2wav_rejected_total") == 1

        first.send(_end(0))
        assert (await first.read()).WhichOneof("event") == "done"
        first.close_requests()
        assert await first.read() is None
        await _eventually_empty(server, fake_decoder)
        chunks, done, _ = await run_stream(bidi_client, stub, _codes(3))  # the slot is free again
        assert done.num_frames == 3


@pytest.mark.parametrize("how", ["cancel", "channel_close"])
async def test_state_freed_when_client_goes_away(fake_decoder, bidi_client, how):
    config = Code2WavConfig(port=0, metrics_port=0, drain_seconds=0.5, first_chunk_frames=2).validate()
    server = Code2WavServer(config, decoder=fake_decoder)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        client = bidi_client(code2wav_pb2_grpc.Code2WavServiceStub(channel).Decode)
        client.send(_start())
        assert (await client.read()).WhichOneof("event") == "credit"
        client.send(_frames(0, _codes(3)))
        assert (await client.read()).WhichOneof("event") == "audio"
        assert len(server.engine.registry) == 1 and fake_decoder.live == 1
        if how == "cancel":
            client.call.cancel()
        else:
            await channel.close()
        await _eventually_empty(server, fake_decoder)
    finally:
        await channel.close()
        await server.stop(0.5)


VIOLATIONS = {
    "frames_before_start": ([_frames(0, _codes(1))], grpc.StatusCode.FAILED_PRECONDITION),
    "wrong_codebook_count_in_start": ([_start(nc=8)], grpc.StatusCode.INVALID_ARGUMENT),
    "wrong_codebook_count_in_frames": (
        [
            _start(),
            pb.DecodeRequest(frames=pb.FrameDelta(first_frame_index=0, num_frames=1, codes_i16=b"\0" * 16)),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "non_contiguous_index": (
        [_start(), _frames(0, _codes(1)), _frames(2, _codes(1))],
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "beyond_credit": ([_start(), _frames(0, _codes(33))], grpc.StatusCode.FAILED_PRECONDITION),
    "second_start": ([_start(), _start()], grpc.StatusCode.FAILED_PRECONDITION),
    "end_count_mismatch": ([_start(), _frames(0, _codes(2)), _end(5)], grpc.StatusCode.INVALID_ARGUMENT),
    "code_out_of_range": (
        [_start(), _frames(0, np.full((1, 16), 4000, np.int16))],
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "ack_beyond_sent_audio": ([_start(), _ack(1)], grpc.StatusCode.INVALID_ARGUMENT),
    "closed_without_end": ([_start(), None], grpc.StatusCode.FAILED_PRECONDITION),
}


@pytest.mark.parametrize("name", list(VIOLATIONS))
async def test_protocol_violation_ends_only_that_stream(fake_decoder, bidi_client, name):
    requests, code = VIOLATIONS[name]
    async with code2wav(fake_decoder) as (server, stub):
        healthy = bidi_client(stub.Decode)
        healthy.send(_start("healthy"))
        assert (await healthy.read()).WhichOneof("event") == "credit"

        bad = bidi_client(stub.Decode)
        for req in requests:
            if req is None:
                bad.close_requests()
            else:
                bad.send(req)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await bad.read() is not None:
                pass
        assert err.value.code() == code, err.value.details()

        # The other stream is unaffected and finishes normally.
        healthy.send(_frames(0, _codes(4)))
        healthy.send(_end(4))
        kinds = []
        while (msg := await healthy.read()) is not None:
            kinds.append(msg.WhichOneof("event"))
            if kinds[-1] == "done":
                healthy.close_requests()
        assert kinds.count("audio") == 2 and kinds[-1] == "done"
        await _eventually_empty(server, fake_decoder)
        assert (
            server.metrics.registry.get_sample_value(
                "tts_errors_total", {"service": "code2wav", "code": code.name}
            )
            == 1
        )


async def test_audio_equals_incremental_decoder_output(bidi_client):
    from qtts.model import IncrementalDecoder
    from qtts.model.codec_decoder import CodecDecoder, CodecDecoderConfig, init_dummy_weights
    from qtts.tiny_model.codec import TINY_DECODER_CONFIG

    codec = CodecDecoder(CodecDecoderConfig.from_dict(TINY_DECODER_CONFIG))
    init_dummy_weights(codec, 0)
    codec.eval()
    codec_shape = CodecShape(codec.cfg.num_quantizers, codec.cfg.codebook_size, codec.samples_per_frame)
    codes, prefix = _codes(13, seed=3) % codec.cfg.codebook_size, _codes(4, seed=4) % codec.cfg.codebook_size

    reference = IncrementalDecoder(codec)
    state = reference.start(torch.from_numpy(prefix.astype(np.int64)))
    expected = reference.decode(state, torch.from_numpy(codes.astype(np.int64)))
    expected_pcm = (expected.clamp(-1, 1) * 32767).round().to(torch.int16).numpy()

    async with code2wav(IncrementalDecoder(codec), codec_shape=codec_shape) as (server, stub):
        chunks, done, _ = await run_stream(bidi_client, stub, codes, prefix=prefix)
        assert [c.num_frames for c in chunks] == TEST_PLAN.split(13)
        pcm = np.frombuffer(b"".join(c.pcm_s16le for c in chunks), dtype="<i2")
        assert pcm.shape == expected_pcm.shape == (13 * codec_shape.samples_per_frame,)
        # Chunked decoding equals one decode within float tolerance: at most 1-2 LSB after rounding.
        assert np.abs(pcm.astype(np.int32) - expected_pcm.astype(np.int32)).max() <= 2
        assert np.abs(expected_pcm).max() > 100  # the comparison is not between two silences
        await _eventually_empty_real(server)


async def _eventually_empty_real(server):
    from tests.grpc_helpers import wait_until

    await wait_until(lambda: len(server.engine.registry) == 0, what="states freed")


async def test_decode_error_fails_the_stream_and_frees_it(bidi_client):
    from tests.grpc_helpers import FakeIncrementalDecoder

    class Failing(FakeIncrementalDecoder):
        def decode(self, state, codes):
            if int(codes[0, 0]) == 7:
                raise RuntimeError("bad kernel")
            return super().decode(state, codes)

    decoder = Failing()
    async with code2wav(decoder) as (server, stub):
        client = bidi_client(stub.Decode)
        client.send(_start())
        client.send(_frames(0, np.full((2, 16), 7, np.int16)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await client.read() is not None:
                pass
        assert err.value.code() == grpc.StatusCode.INTERNAL and "bad kernel" in err.value.details()
        await _eventually_empty(server, decoder)
        chunks, done, _ = await run_stream(bidi_client, stub, _codes(5) % 7)  # the replica still serves
        assert done.num_frames == 5


async def test_drain_lets_an_in_flight_stream_finish(fake_decoder, bidi_client):
    import asyncio

    config = Code2WavConfig(port=0, metrics_port=0, drain_seconds=10).validate()
    server = Code2WavServer(config, decoder=fake_decoder)
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = code2wav_pb2_grpc.Code2WavServiceStub(channel)
    try:
        client = bidi_client(stub.Decode)
        client.send(_start())
        from tests.grpc_helpers import wait_until

        await wait_until(lambda: any(s.started for s in server.engine.registry), what="stream started")
        stopping = asyncio.create_task(server.stop())  # what SIGTERM does
        await asyncio.sleep(0.1)
        chunks, done, _ = await run_stream(bidi_client, stub, _codes(7), client=client)
        assert done.num_frames == 7 and sum(c.num_frames for c in chunks) == 7
        await stopping
        assert fake_decoder.live == 0
        late = bidi_client(stub.Decode)
        late.send(_start())
        with pytest.raises(grpc.aio.AioRpcError):
            await late.read(timeout=5)
    finally:
        await channel.close()
        await server.stop(0.5)


async def test_slot_decoder_engine_serves_the_same_audio_as_the_incremental_decoder(bidi_client):
    """`--decode-engine slots` (the GPU engine; eager on a CPU) is a drop-in for the reference."""
    from qtts.decode_engine import SlotDecoderConfig, build_slot_decoder
    from qtts.model import IncrementalDecoder
    from qtts.model.codec_decoder import CodecDecoder, CodecDecoderConfig, init_dummy_weights
    from qtts.tiny_model.codec import TINY_DECODER_CONFIG

    codec = CodecDecoder(CodecDecoderConfig.from_dict(TINY_DECODER_CONFIG))
    init_dummy_weights(codec, 0)
    codec.eval()
    codec_shape = CodecShape(codec.cfg.num_quantizers, codec.cfg.codebook_size, codec.samples_per_frame)
    codes, prefix = _codes(11, seed=5) % codec.cfg.codebook_size, _codes(3, seed=6) % codec.cfg.codebook_size
    pcm = {}
    engines = {
        "incremental": IncrementalDecoder(codec),
        "slots": build_slot_decoder(
            codec, SlotDecoderConfig(max_streams=4, precision="fp32", cuda_graphs=False)
        ),
    }
    for name, decoder in engines.items():
        async with code2wav(decoder, codec_shape=codec_shape, max_states=4) as (server, stub):
            chunks, done, _ = await run_stream(bidi_client, stub, codes, prefix=prefix)
            pcm[name] = np.frombuffer(b"".join(c.pcm_s16le for c in chunks), dtype="<i2").astype(np.int32)
            await _eventually_empty_real(server)
    assert pcm["slots"].shape == pcm["incremental"].shape == (11 * codec_shape.samples_per_frame,)
    assert np.abs(pcm["incremental"]).max() > 100
    assert np.abs(pcm["slots"] - pcm["incremental"]).max() <= 2
    assert engines["slots"].num_live == 0  # the service freed the slot


def test_config_selects_the_decode_engine():
    cfg = config_from_args(["--decode-engine", "slots", "--decode-precision", "bf16"])
    assert (cfg.decode_engine, cfg.decode_precision) == ("slots", "bf16")
    with pytest.raises(InvalidArgument, match="--decode-precision"):
        config_from_args(["--decode-engine", "slots", "--decode-precision", "fp8"])


def test_max_batch_defaults_by_decode_engine(monkeypatch):
    monkeypatch.delenv("TTS_CODE2WAV_MAX_BATCH", raising=False)
    assert config_from_args([]).batch_limit == 64
    assert config_from_args(["--decode-engine", "slots"]).batch_limit == 256
    assert Code2WavConfig().batch_limit == 64
    assert Code2WavConfig(decode_engine="slots").validate().batch_limit == 256
    # An explicit flag or env var wins over the engine's default, the flag over the env var.
    assert config_from_args(["--decode-engine", "slots", "--max-batch", "32"]).batch_limit == 32
    assert config_from_args(["--max-batch", "128"]).batch_limit == 128
    monkeypatch.setenv("TTS_CODE2WAV_MAX_BATCH", "48")
    assert config_from_args(["--decode-engine", "slots"]).batch_limit == 48
    assert config_from_args(["--decode-engine", "slots", "--max-batch", "16"]).batch_limit == 16
    with pytest.raises(InvalidArgument, match="--max-batch"):
        config_from_args(["--max-batch", "0"])


async def test_server_passes_the_engine_batch_limit(fake_decoder):
    server = Code2WavServer(
        Code2WavConfig(port=0, metrics_port=0, drain_seconds=0.5, decode_engine="slots").validate(),
        decoder=fake_decoder,
    )
    await server.start()
    try:
        assert server.engine.max_batch == 256
    finally:
        await server.stop(0.5)


def test_prefix_cache_entries_flag_reaches_the_slots_engine():
    from services.code2wav.model_loader import load_decoder

    assert config_from_args([]).prefix_cache_entries == 512  # a 200-voice pool fits
    cfg = config_from_args(["--decode-engine", "slots", "--prefix-cache-entries", "3", "--max-states", "2"])
    engine, _ = load_decoder(cfg)
    assert engine.config.prefix_cache_entries == 3 and engine.pool.capacity == 2
    with pytest.raises(InvalidArgument, match="--prefix-cache-entries"):
        config_from_args(["--prefix-cache-entries", "-1"])


def test_cudnn_benchmark_flag_reaches_the_slots_engine():
    from services.code2wav.model_loader import load_decoder

    assert config_from_args([]).cudnn_benchmark is True
    for flag, expected in (("true", True), ("false", False)):
        cfg = config_from_args(["--decode-engine", "slots", "--max-states", "2", "--cudnn-benchmark", flag])
        engine, _ = load_decoder(cfg)
        assert engine.config.cudnn_benchmark is expected


async def test_prefix_state_cache_hits_and_misses_are_counted():
    """The slots engine on the tiny model: two streams with one reference prefix decode it once."""
    from prometheus_client import CollectorRegistry

    from qtts.serving.metrics import Code2WavMetrics
    from services.code2wav.model_loader import load_decoder
    from services.code2wav.starts import make_states

    cfg = config_from_args(["--decode-engine", "slots", "--max-states", "4"])
    decoder, codec_shape = load_decoder(cfg)
    metrics = Code2WavMetrics(CollectorRegistry())
    prefix = np.random.default_rng(0).integers(0, 2048, (6, 16)).astype(np.int16)
    device = "cpu"  # the slots engine takes host codes
    states = [make_states(decoder, device, metrics, [prefix])[0] for _ in range(2)]
    states.append(make_states(decoder, device, metrics, [None])[0])
    assert metrics.prefix_state_misses_total._value.get() == 1
    assert metrics.prefix_state_hits_total._value.get() == 1  # no-prefix streams count neither
    for s in states:
        decoder.free(s)
