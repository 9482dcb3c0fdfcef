"""The talker servicer through real grpc.aio servers, with in-process code2wav replicas.

The model core is a fake here (FakeBundle/FakeGenerator: text "frames=N" generates N frames);
`test_talker_real_model.py` runs the same path on the tiny real model.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from qtts.pb import talker_pb2, tts_pb2
from qtts.streams.hash_ring import HashRing
from tests.services.talker.fakes import FakeBundle, FakeCode2Wav, FakeGenerator, FakeSpec
from tests.services.talker.stack import eventually, generate_all, talker_stack

REF_PCM = (np.sin(np.arange(24000) / 10) * 0.3).astype("<f4").tobytes()
CLONE = dict(task_type=tts_pb2.TASK_TYPE_VOICE_CLONE, reference_pcm_f32=REF_PCM, reference_text="a reference")


def fake_stack(replicas=None, model_type="base", **kw):
    return talker_stack(
        replicas or [FakeCode2Wav("c2w-a")],
        bundle=FakeBundle(model_type),
        generator_factory=FakeGenerator,
        spec_factory=FakeSpec,
        **kw,
    )


async def test_audio_is_frames_times_1920_samples_in_order_within_credit():
    async with fake_stack(credit_window_frames=3) as s:
        chunks, summary = await generate_all(s.stub, request_id="r1", text="frames=7", **CLONE)
        assert sum(c.num_samples for c in chunks) == 7 * 1920
        pcm = np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2")
        assert pcm.size == 7 * 1920
        np.testing.assert_array_equal(pcm, np.repeat(np.arange(7), 1920))
        assert [c.first_frame_index for c in chunks] == sorted(c.first_frame_index for c in chunks)
        assert summary.finish_reason == tts_pb2.FINISH_REASON_STOP
        assert (summary.num_frames, summary.num_samples) == (7, 7 * 1920)
        assert summary.code2wav_replica == "c2w-a"
        assert summary.timings.total_ns >= summary.timings.first_audio_ns > 0
        log = s.replicas[0].servicer.logs[0]
        assert log.request_id == "r1" and log.prefix_frames == 3  # ICL reference codes as prefix
        assert log.violations == [] and log.ended and log.frames == list(range(7))
        # Chunks are acknowledged after delivery (acks after StreamEnd may arrive after the close).
        assert log.acks and log.acks == sorted(set(log.acks)) and all(a % 1920 == 0 for a in log.acks)
        await eventually(lambda: s.replicas[0].servicer.live == 0 and s.generator.num_active == 0)
        assert s.gauge("tts_talker_active_streams") == 0
        assert s.gauge("tts_talker_frames_total") == 7


async def test_frames_go_to_code2wav_a_chunk_at_a_time_when_it_announces_its_plan():
    """A replica that announces its chunk plan (2, then 4, 4, 8...) gets frames only in whole chunks
    (one delta may carry several when the engine ran ahead), the remainder at the end. The audio is
    the same as without a plan."""
    c2w = FakeCode2Wav("c2w-a", window=32, plan=(2, (4, 4, 8)))
    async with fake_stack([c2w], credit_window_frames=8) as s:
        chunks, summary = await generate_all(s.stub, request_id="r1", text="frames=23", **CLONE)
        pcm = np.frombuffer(b"".join(c.audio for c in chunks), dtype="<i2")
        np.testing.assert_array_equal(pcm, np.repeat(np.arange(23), 1920))
        log = c2w.logs[0]
        assert log.violations == [] and log.frames == list(range(23)) and log.ended
        # Chunk boundaries at 2, 6, 10, 18, 26: every delta ends on one, except the last (23).
        ends = np.cumsum(log.delta_sizes).tolist()
        assert ends[-1] == 23 and set(ends[:-1]) <= {2, 6, 10, 18}
        assert len(ends) <= 5
        assert summary.num_frames == 23


async def test_stream_without_credit_stops_generating_at_the_window():
    # The replica grants 40 frames and never more: the talker sends those 40, generates 3 more into
    # its buffer (its own window) and then skips the stream. (40 frames are 3.2 s of audio: until
    # its listener runs dry the held stream is not "behind", which would rightly hold admission,
    # and keep the other stream below from starting, on a slow machine.)
    c2w = FakeCode2Wav("c2w-a", window=40, hold=True)
    async with fake_stack([c2w], credit_window_frames=3, max_batch=4) as s:
        call = s.stub.Generate(talker_pb2.GenerateRequest(request_id="held", text="frames=100000", **CLONE))
        await eventually(lambda: "held" in s.generator._active and s.generator._active["held"][1] >= 43)
        await asyncio.sleep(0.2)
        produced = s.generator._active["held"][1]
        granted = c2w.logs[0].max_allowed
        assert granted == 40 and produced == granted + 3
        assert len(c2w.logs[0].frames) == granted and c2w.logs[0].violations == []
        # Another stream (within its granted frames) is not held up by the stalled one.
        chunks, summary = await generate_all(s.stub, request_id="other", text="frames=4", **CLONE)
        assert summary.num_frames == 4 and sum(c.num_samples for c in chunks) == 4 * 1920
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0 and c2w.live == 0)


async def test_client_cancel_frees_generator_slot_decoder_call_and_metrics():
    c2w = FakeCode2Wav("c2w-a")
    async with fake_stack([c2w]) as s:
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(request_id="gone", text="frames=100000 slow", **CLONE)
        )
        first = await call.read()
        assert first.WhichOneof("event") == "audio"
        assert s.gauge("tts_talker_active_streams") == 1
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0)
        await eventually(lambda: c2w.live == 0 and s.gauge("tts_talker_active_streams") == 0)
        assert c2w.logs[0].cancelled and not c2w.logs[0].ended
        assert s.talker.engine.counts() == (0, 0)


async def test_max_new_frames_ends_with_length():
    async with fake_stack() as s:
        chunks, summary = await generate_all(s.stub, text="frames=50", max_new_frames=4, **CLONE)
        assert summary.finish_reason == tts_pb2.FINISH_REASON_LENGTH
        assert summary.num_frames == 4 and sum(c.num_samples for c in chunks) == 4 * 1920


async def test_frame_cap_is_an_internal_error_not_a_success():
    c2w = FakeCode2Wav("c2w-a")
    async with fake_stack([c2w]) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, text="frames=3 cap", **CLONE)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "frame cap without end of speech" in err.value.details()
        await eventually(lambda: c2w.live == 0 and s.generator.num_active == 0)


@pytest.mark.parametrize(
    ("model_type", "fields", "code", "text"),
    [
        (
            "base",
            dict(task_type=tts_pb2.TASK_TYPE_CUSTOM_VOICE, voice="vivian"),
            "INVALID_ARGUMENT",
            "base model",
        ),
        ("base", dict(task_type=tts_pb2.TASK_TYPE_VOICE_CLONE), "INVALID_ARGUMENT", "reference audio"),
        (
            "base",
            dict(task_type=tts_pb2.TASK_TYPE_VOICE_CLONE, reference_pcm_f32=REF_PCM),
            "INVALID_ARGUMENT",
            "reference_text",
        ),
        ("base", dict(CLONE, language="klingon"), "INVALID_ARGUMENT", "unsupported language"),
        ("custom_voice", dict(voice="nobody"), "NOT_FOUND", "unknown speaker"),
        ("custom_voice", dict(), "INVALID_ARGUMENT", "needs a speaker"),
        ("voice_design", dict(), "INVALID_ARGUMENT", "instructions"),
    ],
)
async def test_requests_the_model_cannot_serve_are_rejected_clearly(model_type, fields, code, text):
    async with fake_stack(model_type=model_type) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, text="hello", **fields)
        assert err.value.code().name == code
        assert text in err.value.details()


async def test_custom_voice_and_voice_design_reach_the_prompt_builder():
    async with fake_stack(model_type="custom_voice") as s:
        _, summary = await generate_all(s.stub, text="frames=2", voice="Vivian", language="English")
        assert summary.num_frames == 2
        spec = s.talker.bundle.specs[-1]
        assert (spec.task, spec.speaker, spec.language, spec.voice_prompt) == (
            "custom_voice",
            "vivian",
            "english",
            None,
        )
        info = await s.stub.GetModelInfo(talker_pb2.GetModelInfoRequest())
        assert info.model_type == "custom_voice" and list(info.speakers) == ["ryan", "vivian"]
        assert info.samples_per_frame == 1920 and info.num_codebooks == 16


async def test_beyond_batch_and_queue_requests_are_rejected_with_resource_exhausted():
    async with fake_stack(max_batch=1, max_queue=0) as s:
        call = s.stub.Generate(talker_pb2.GenerateRequest(request_id="a", text="frames=100000 slow", **CLONE))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, request_id="b", text="frames=2", **CLONE)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0)
        _, summary = await generate_all(s.stub, request_id="c", text="frames=2", **CLONE)
        assert summary.num_frames == 2


async def test_replica_that_goes_away_fails_its_stream_and_new_streams_use_the_others():
    dying, healthy = FakeCode2Wav("c2w-a", die_after_frames=2), FakeCode2Wav("c2w-b")
    async with fake_stack([dying, healthy], health_interval_s=60.0) as s:
        a, b = s.replicas
        ring = HashRing([a.address, b.address], vnodes=s.talker.config.ring_vnodes)
        rid = next(f"r{i}" for i in range(1000) if ring.get(f"r{i}") == a.address)

        async def die():
            asyncio.get_running_loop().create_task(a.host.server.stop(0))

        dying.on_die = die
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, request_id=rid, text="frames=50", **CLONE)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"code2wav replica {a.address}" in err.value.details()
        await eventually(lambda: s.generator.num_active == 0)
        # The same key now lands on the remaining replica; streams keyed to it never moved.
        _, summary = await generate_all(s.stub, request_id=rid, text="frames=3", **CLONE)
        assert summary.code2wav_replica == "c2w-b" and summary.num_frames == 3
        assert s.talker.replicas.healthy == {b.address}


async def test_unreachable_replica_is_skipped_before_the_stream_starts():
    async with fake_stack([FakeCode2Wav("c2w-a"), FakeCode2Wav("c2w-b")], health_interval_s=60.0) as s:
        a, b = s.replicas
        await a.host.server.stop(0)
        ring = HashRing([a.address, b.address], vnodes=s.talker.config.ring_vnodes)
        rid = next(f"r{i}" for i in range(1000) if ring.get(f"r{i}") == a.address)
        _, summary = await generate_all(s.stub, request_id=rid, text="frames=3", **CLONE)
        assert summary.code2wav_replica == "c2w-b"


async def test_drain_finishes_in_flight_streams_and_refuses_new_ones():
    async with fake_stack() as s:
        call = s.stub.Generate(
            talker_pb2.GenerateRequest(request_id="inflight", text="frames=40 slow", **CLONE)
        )
        await call.read()
        stopping = asyncio.create_task(s.talker.stop(grace=10.0))
        await asyncio.sleep(0.05)
        samples, summary = 1920, None
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.WhichOneof("event") == "audio":
                samples += msg.audio.num_samples
            else:
                summary = msg.summary
        assert summary is not None and summary.num_frames == 40 and samples == 40 * 1920
        with pytest.raises(grpc.aio.AioRpcError):
            await generate_all(s.stub, text="frames=2", **CLONE)
        await stopping


class RejectingCode2Wav(FakeCode2Wav):
    """A replica at its state bound: every stream is refused."""

    async def Decode(self, request_iterator, context):  # noqa: N802
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decoder state bound reached")
        yield  # pragma: no cover - makes this an async generator like the real handler


async def test_a_replica_refusing_the_stream_ends_it_with_its_status_and_frees_the_slot():
    async with fake_stack([RejectingCode2Wav("full")]) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_all(s.stub, text="frames=100000 slow", **CLONE)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "state bound" in err.value.details()
        await eventually(lambda: s.generator.num_active == 0 and s.talker.engine.counts() == (0, 0))
        assert s.talker.replicas.healthy == {s.replicas[0].address}  # a refusal is not a dead replica


async def test_a_streams_first_chunk_is_timed_per_hop_apart_from_the_rest():
    """tts_talker_first_chunk_hop_seconds: one observation per hop for each stream's first chunk,
    whose generate hop runs from submission (so it holds the queue and the prefill); later chunks
    go to tts_talker_chunk_hop_seconds alone."""
    c2w = FakeCode2Wav("c2w-a", window=32, plan=(2, (4, 4, 8)))
    async with fake_stack([c2w], credit_window_frames=8) as s:
        for rid in ("r1", "r2"):
            await generate_all(s.stub, request_id=rid, text="frames=14", **CLONE)
        registry = s.talker.metrics.registry
        hops = ("generate", "engine_to_loop", "to_code2wav", "code2wav", "to_gateway")
        for hop in hops:
            first = registry.get_sample_value("tts_talker_first_chunk_hop_seconds_count", {"hop": hop})
            assert first == 2, hop  # one first chunk per stream
            rest = registry.get_sample_value("tts_talker_chunk_hop_seconds_count", {"hop": hop})
            assert rest and rest >= 4, hop  # chunks 2.. of both streams (ends 6, 10, 14)
        total = sum(
            registry.get_sample_value("tts_talker_first_chunk_hop_seconds_sum", {"hop": hop}) for hop in hops
        )
        assert total > 0
        # Every chunk's code2wav hop, less the 1 us the replica says it held it: in transit.
        chunks = registry.get_sample_value("tts_talker_chunk_hop_seconds_count", {"hop": "code2wav"})
        transit = registry.get_sample_value("tts_talker_code2wav_transit_seconds_count")
        assert transit == chunks + 2
        # Each chunk's audio was stamped as the talker read it off its call: its wait there after.
        queued = registry.get_sample_value("tts_talker_code2wav_audio_queued_seconds_count")
        assert queued == chunks + 2
        hop_sum = registry.get_sample_value(
            "tts_talker_chunk_hop_seconds_sum", {"hop": "code2wav"}
        ) + registry.get_sample_value("tts_talker_first_chunk_hop_seconds_sum", {"hop": "code2wav"})
        assert 0 <= registry.get_sample_value("tts_talker_code2wav_audio_queued_seconds_sum") <= hop_sum


@pytest.mark.parametrize("window", [3, 200])
async def test_audio_is_acknowledged_every_16_frames_or_at_once_when_the_credit_waits_on_it(window):
    """code2wav grants `window` frames past the acknowledged audio. With a wide window the talker
    acknowledges every 16 frames (1.28 s) of audio handed on, not every chunk; with a narrow one
    frames wait for credit, and each audio chunk is acknowledged at once, so the stream never waits
    on an ack it held back."""
    c2w = FakeCode2Wav("c2w-a", window=window, plan=(1, (1, 2, 2, 4)))
    async with fake_stack([c2w], credit_window_frames=8) as s:
        chunks, summary = await generate_all(s.stub, request_id="r1", text="frames=40", **CLONE)
        assert summary.num_frames == 40 and sum(c.num_frames for c in chunks) == 40
        log = c2w.logs[0]
        assert log.violations == [] and log.frames == list(range(40)) and log.ended
        acked = [a // 1920 for a in log.acks]
        assert acked == sorted(set(acked))
        if window == 200:
            # (acks after StreamEnd may arrive after the replica stopped reading: fewer recorded)
            assert all(b - a >= 16 for a, b in zip([0, *acked], acked, strict=False))
            assert len(acked) <= 40 // 16 < len(chunks)
        else:  # the credit depends on every ack: each went out before the frames it freed
            assert acked and acked[-1] >= 40 - window
