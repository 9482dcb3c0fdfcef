"""code2wav scheduling: playback deadlines, earliest-deadline-first batches, coalescing, slack metrics.

The engine is driven directly (`_decode_ready`, no gRPC) with a simulated clock; waits are bounded by
timeouts, and only order and batch width are asserted, never durations.
"""

from __future__ import annotations

import asyncio
import math
import threading
from contextlib import asynccontextmanager

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from qtts.request.errors import InvalidArgument
from qtts.serving.metrics import Code2WavMetrics
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import DecodedAudio
from services.code2wav.config import Code2WavConfig, config_from_args
from services.code2wav.core import Code2WavCore
from services.code2wav.credit import CreditPolicy
from services.code2wav.server import Code2WavServer
from services.code2wav.stream import CodecShape, DecodeStream
from tests.grpc_helpers import FakeIncrementalDecoder

SPF = 1920  # samples per 80 ms frame at 24 kHz


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class CallLog(FakeIncrementalDecoder):
    """Records each decode call as the list of states it decoded, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[list[int]] = []
        self._in_batch = False

    def decode(self, state, codes):
        if not self._in_batch:
            self.calls.append([id(state)])
        return super().decode(state, codes)

    def decode_batch(self, states, codes):
        self.calls.append([id(s) for s in states])
        self._in_batch = True
        try:
            return super().decode_batch(states, codes)
        finally:
            self._in_batch = False


def _codes(n: int) -> np.ndarray:
    return np.ones((n, 16), dtype=np.int16)


@asynccontextmanager
async def engine_with(plan: ChunkPlan, **kw):
    clock = FakeClock()
    decoder = CallLog()
    engine = Code2WavCore(decoder, Code2WavMetrics(CollectorRegistry()), plan=plan, clock=clock, **kw)
    try:
        yield engine, decoder, clock
    finally:
        await engine.close()


async def _open(engine: Code2WavCore, *names: str) -> dict[str, DecodeStream]:
    """Open streams and wait until the worker has made their decoder states."""
    streams = {n: await engine.open_stream(n, 16) for n in names}
    for _ in range(1000):
        if all(s.started for s in streams.values()):
            return streams
        await asyncio.sleep(0.005)
    raise AssertionError("decoder states were not made")


def _feed(stream: DecodeStream, n: int) -> None:
    stream.add_frames(stream.received_frames, _codes(n))


def _named(decoder: CallLog, streams: dict[str, DecodeStream]) -> list[list[str]]:
    by_state = {id(s.decoder_state): name for name, s in streams.items()}
    return [[by_state[i] for i in call] for call in decoder.calls]


async def _decode_now(engine: Code2WavCore) -> None:
    await asyncio.wait_for(engine._decode_ready(), timeout=5)


async def test_earliest_deadline_first_and_new_streams_before_everyone():
    async with engine_with(ChunkPlan(2, (4,)), max_batch=2) as (engine, decoder, clock):
        # Opened in the reverse of the order they must be decoded in.
        streams = await _open(engine, "far", "near", "new")
        for name in ("far", "near"):
            _feed(streams[name], 2)
        await _decode_now(engine)  # both start playing at t=100
        _feed(streams["far"], 4)
        await _decode_now(engine)  # "far" has 6 frames of audio out, "near" 2
        # The client took all of "far"'s audio: acks say what was read, not when playback runs dry.
        streams["far"].ack(streams["far"].emitted_samples)
        assert streams["near"].deadline == pytest.approx(100 + 2 * SPF / 24000)
        assert streams["far"].deadline == pytest.approx(100 + 6 * SPF / 24000)
        assert streams["new"].deadline == -math.inf

        decoder.calls.clear()
        for name in ("far", "near", "new"):
            _feed(streams[name], 4 if name != "new" else 2)
        await _decode_now(engine)
        # The new stream's first chunk in a call of its own, then the rest by deadline.
        assert _named(decoder, streams) == [["new"], ["near", "far"]]


async def test_a_call_takes_at_most_max_call_frames_earliest_deadlines_first():
    async with engine_with(ChunkPlan(2, (4,)), max_batch=8, max_call_frames=8) as (engine, decoder, clock):
        streams = await _open(engine, "a", "b", "c", "d")
        for name in streams:
            _feed(streams[name], 2)
        await _decode_now(engine)  # all four play from t=100, 2 frames each
        for i, name in enumerate(("d", "c", "b", "a")):  # "d" has the least audio out
            streams[name].ack(streams[name].emitted_samples)
            _feed(streams[name], 4 * (i + 1))
            if i:
                await _decode_now(engine)
        decoder.calls.clear()
        for name in streams:
            _feed(streams[name], 4)
        for s in streams.values():
            s.ack(s.emitted_samples)
        order = sorted(streams, key=lambda n: streams[n].deadline)
        assert order == ["d", "c", "b", "a"]  # not the order they were opened in
        await _decode_now(engine)
        # 4-frame chunks, 8 frames a call: two streams a call, the nearest deadlines first.
        assert _named(decoder, streams) == [order[:2], order[2:]]
        # One chunk longer than the cap still goes, alone.
        engine.max_call_frames = 3
        decoder.calls.clear()
        for name in ("a", "b"):
            _feed(streams[name], 4)
        await _decode_now(engine)
        assert sorted(map(len, decoder.calls)) == [1, 1]


async def test_first_chunks_are_decoded_and_delivered_before_steady_state_work():
    """Two streams starting and three playing, all ready at once: the first chunks go in one call
    ahead of the others, and their audio is out before the steady-state call begins. Without a
    first chunk ready, a call takes every ready stream."""
    async with engine_with(ChunkPlan(1, (4,)), max_batch=64) as (engine, decoder, _):
        streams = await _open(engine, "a", "b", "c", "new1", "new2")
        for name in ("a", "b", "c"):
            _feed(streams[name], 1)
        await _decode_now(engine)
        decoder.calls.clear()
        heard_before_call: list[list[str]] = []
        decode_batch = decoder.decode_batch

        def recording(states, codes):
            heard_before_call.append(sorted(n for n, st in streams.items() if st.emitted_samples))
            return decode_batch(states, codes)

        decoder.decode_batch = recording
        for name in ("a", "b", "c"):
            _feed(streams[name], 4)
        for name in ("new1", "new2"):
            _feed(streams[name], 1)
        await _decode_now(engine)
        assert _named(decoder, streams) == [["new1", "new2"], ["a", "b", "c"]]
        assert heard_before_call == [["a", "b", "c"], ["a", "b", "c", "new1", "new2"]]
        decoder.calls.clear()
        for name in streams:
            _feed(streams[name], 4)
        await _decode_now(engine)
        assert [sorted(call) for call in _named(decoder, streams)] == [sorted(streams)]


async def test_the_first_chunk_lane_never_passes_over_playing_streams_twice_in_a_row():
    """In a burst of opens a new first chunk is ready before every call: a lane call that left a
    playing stream's ready chunk behind is followed by a call that takes it (first chunks still
    lead that call)."""
    async with engine_with(ChunkPlan(1, (1,)), max_batch=64) as (engine, _, _):
        streams = await _open(engine, "a", "new1", "new2", "new3")
        _feed(streams["a"], 1)
        await _decode_now(engine)  # "a" plays
        _feed(streams["a"], 1)
        _feed(streams["new1"], 1)
        by_stream = {id(s): n for n, s in streams.items()}

        def collect() -> list[str]:
            return [by_stream[id(s)] for s, _, _ in engine._collect()]

        assert collect() == ["new1"]  # the lane
        _feed(streams["new2"], 1)  # the next state made, its first chunk ready
        assert collect() == ["new2", "a"]  # not the lane again: "a" waited once
        _feed(streams["new3"], 1)
        assert collect() == ["new3"]  # "a" is in flight: nothing playing is passed over


async def test_coalescing_waits_for_more_streams_until_the_batch_is_full():
    # 16-frame chunks: 1.28 s of audio out, so the deadline leaves room for a long wait.
    async with engine_with(ChunkPlan(16, (16,)), max_batch=2, coalesce_max_s=1.0, deadline_safety_s=0.1) as (
        engine,
        decoder,
        _,
    ):
        streams = await _open(engine, "a", "b")
        for s in streams.values():
            _feed(s, 16)
        await _decode_now(engine)  # first chunks: no waiting, one call
        assert _named(decoder, streams) == [["a", "b"]]

        _feed(streams["a"], 16)
        task = asyncio.create_task(engine._decode_ready())
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(decoder.calls) == 1 and not task.done()  # "a" is ready, but waits for company
        _feed(streams["b"], 16)
        engine.notify()
        await asyncio.wait_for(task, timeout=5)
        assert _named(decoder, streams)[1:] == [["a", "b"]]


async def test_coalescing_is_bounded_by_the_clock():
    async with engine_with(ChunkPlan(16, (16,)), coalesce_max_s=1.0, deadline_safety_s=0.1) as (
        engine,
        decoder,
        clock,
    ):
        streams = await _open(engine, "a", "b")
        for s in streams.values():
            _feed(s, 16)
        await _decode_now(engine)
        _feed(streams["a"], 16)
        task = asyncio.create_task(engine._decode_ready())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        clock.t += 1.0  # the longest wait has passed; any wake-up re-checks the clock
        engine.notify()
        await asyncio.wait_for(task, timeout=5)
        assert _named(decoder, streams)[1:] == [["a"]]


async def test_no_coalescing_for_first_chunks_or_tight_deadlines():
    async with engine_with(ChunkPlan(2, (16,)), coalesce_max_s=30.0, deadline_safety_s=0.1) as (
        engine,
        decoder,
        clock,
    ):
        streams = await _open(engine, "a", "idle")  # "idle" could become ready, so waiting would pay
        _feed(streams["a"], 2)
        await _decode_now(engine)  # a first chunk never waits
        assert _named(decoder, streams) == [["a"]]

        clock.t += 0.1  # 2 frames (0.16 s) were handed on at t=100: 0.06 s left, under the safety
        _feed(streams["a"], 16)
        await _decode_now(engine)
        assert _named(decoder, streams) == [["a"], ["a"]]


async def test_a_first_chunk_ends_a_coalescing_wait_and_goes_first():
    async with engine_with(ChunkPlan(16, (16,)), coalesce_max_s=30.0, deadline_safety_s=0.1) as (
        engine,
        decoder,
        _,
    ):
        streams = await _open(engine, "a", "new")
        _feed(streams["a"], 16)
        await _decode_now(engine)
        _feed(streams["a"], 16)
        task = asyncio.create_task(engine._decode_ready())
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        _feed(streams["new"], 16)
        engine.notify()
        await asyncio.wait_for(task, timeout=5)
        # The first chunk in its own call (the first-chunk lane), then the wait's stream.
        assert _named(decoder, streams) == [["a"], ["new"], ["a"]]


def test_slack_and_underruns_follow_the_playback_clock():
    clock = FakeClock(10.0)
    metrics = Code2WavMetrics(CollectorRegistry())
    stream = DecodeStream("r", ChunkPlan(2, (4,)), CreditPolicy(), CodecShape(), metrics, clock=clock)

    def deliver(frames: int) -> None:
        stream.deliver(DecodedAudio(b"", frames * SPF, stream.decoded_frames, frames, 0))

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, labels) or 0.0

    deliver(2)  # playback starts: no slack for the first chunk
    assert stream.first_audio_at == 10.0 and stream.deadline == pytest.approx(10.16)
    assert sample("tts_code2wav_deadline_slack_seconds_count") == 0
    clock.t = 10.1
    deliver(4)  # 0.06 s before the listener runs dry
    clock.t = 10.6
    deliver(4)  # deadline 10.48: 0.12 s late
    assert sample("tts_code2wav_deadline_slack_seconds_count") == 2
    assert sample("tts_code2wav_deadline_slack_seconds_sum") == pytest.approx(0.06 - 0.12)
    bucket = "tts_code2wav_deadline_slack_seconds_bucket"
    assert [sample(bucket, le=le) for le in ("0.0", "0.05", "0.1")] == [1, 1, 2]
    assert sample("tts_code2wav_underruns_total") == 1
    assert stream.deadline == pytest.approx(10.0 + 10 * SPF / 24000)


def test_scheduling_flags(monkeypatch):
    monkeypatch.delenv("TTS_CODE2WAV_COALESCE_MAX_MS", raising=False)
    cfg = config_from_args([])
    assert (cfg.coalesce_max_ms, cfg.deadline_safety_ms, cfg.max_call_frames) == (0.0, 100.0, 1024)
    assert config_from_args(["--max-call-frames", "0"]).max_call_frames == 0
    with pytest.raises(InvalidArgument, match="--max-call-frames"):
        config_from_args(["--max-call-frames", "-1"])
    cfg = config_from_args(["--coalesce-max-ms", "0", "--deadline-safety-ms", "50"])
    assert (cfg.coalesce_max_ms, cfg.deadline_safety_ms) == (0.0, 50.0)
    monkeypatch.setenv("TTS_CODE2WAV_COALESCE_MAX_MS", "4.5")
    assert config_from_args([]).coalesce_max_ms == 4.5
    with pytest.raises(InvalidArgument, match="--coalesce-max-ms"):
        config_from_args(["--coalesce-max-ms", "-1"])


async def test_server_passes_the_scheduling_settings(fake_decoder):
    config = Code2WavConfig(
        port=0,
        metrics_port=0,
        drain_seconds=0.5,
        coalesce_max_ms=7,
        deadline_safety_ms=80,
        max_call_frames=96,
    )
    server = Code2WavServer(config.validate(), decoder=fake_decoder)
    await server.start()
    try:
        assert server.engine.coalesce_max_s == pytest.approx(0.007)
        assert server.engine.deadline_safety_s == pytest.approx(0.08)
        assert server.engine.max_call_frames == 96
    finally:
        await server.stop(0.5)


class SlowStart(CallLog):
    """Makes decoder states only once `made` is set (an ICL prefix being decoded, or a decode call
    in flight ahead of it); `fail` makes `start` raise instead."""

    def __init__(self, fail: Exception | None = None):
        super().__init__()
        self.made = threading.Event()
        self.entered = threading.Event()  # a state is being made
        self.fail = fail
        self.freed = 0

    def start(self, prefix_codes=None):
        self.entered.set()
        assert self.made.wait(timeout=10)
        if self.fail is not None:
            raise self.fail
        return super().start(prefix_codes)

    def free(self, state) -> None:
        self.freed += 1
        super().free(state)


async def _until(predicate, what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


async def test_the_first_grant_goes_out_before_the_decoder_state_and_frames_wait_for_it():
    decoder = SlowStart()
    engine = Code2WavCore(decoder, Code2WavMetrics(CollectorRegistry()), plan=ChunkPlan(1, (2,)))
    await engine.start()
    try:
        stream = await engine.open_stream("r", 16)
        assert stream.granted > 0 and not stream.started  # the grant, with the state still coming
        events = stream.events()
        credit = await asyncio.wait_for(anext(events), 5)
        assert credit.plan == ChunkPlan(1, (2,))
        _feed(stream, 1)
        engine.notify(stream)
        await asyncio.sleep(0.05)
        assert decoder.calls == []  # nothing decodes before its state exists
        decoder.made.set()
        audio = await asyncio.wait_for(anext(events), 5)
        assert isinstance(audio, DecodedAudio) and audio.num_frames == 1 and stream.started
    finally:
        await engine.close()


async def test_a_state_that_cannot_be_made_fails_its_stream_and_frees_its_place():
    decoder = SlowStart(fail=InvalidArgument("the prefix does not fit this decoder"))
    decoder.made.set()
    engine = Code2WavCore(decoder, Code2WavMetrics(CollectorRegistry()))
    await engine.start()
    try:
        stream = await engine.open_stream("r", 16)
        with pytest.raises(InvalidArgument, match="does not fit"):
            async for _ in stream.events():
                pass
        assert len(engine.registry) == 0
    finally:
        await engine.close()


async def test_a_stream_released_while_its_state_is_made_frees_the_state_once_made():
    decoder = SlowStart()
    engine = Code2WavCore(decoder, Code2WavMetrics(CollectorRegistry()))
    await engine.start()
    try:
        stream = await engine.open_stream("r", 16)
        await _until(decoder.entered.is_set, "the state being made")
        engine.release(stream)
        decoder.made.set()
        await _until(lambda: decoder.freed == 1, "the state freed")
        assert decoder.live == 0 and stream.decoder_state is None
    finally:
        await engine.close()


async def test_a_stream_released_before_its_turn_gets_no_state():
    decoder = SlowStart()
    engine = Code2WavCore(decoder, Code2WavMetrics(CollectorRegistry()))
    await engine.start()
    try:
        first = await engine.open_stream("first", 16)
        await _until(decoder.entered.is_set, "the first state being made")
        second = await engine.open_stream("second", 16)  # queued behind the first
        engine.release(second)
        decoder.made.set()
        await _until(lambda: first.started, "the first state made")
        await asyncio.sleep(0.05)
        assert decoder.live == 1 and decoder.freed == 0 and second.decoder_state is None
    finally:
        await engine.close()
