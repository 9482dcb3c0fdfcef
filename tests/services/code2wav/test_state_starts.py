"""code2wav makes new streams' decoder states in batches between decode calls: a decode call waits
behind at most one batch of starts (observed from the order of the worker's jobs), an error stays
with its stream, and the slots engine serves the same audio to a burst of prefix streams."""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from qtts.request.errors import GenerationFailed, Unavailable
from qtts.serving.metrics import Code2WavMetrics
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import DecodedAudio, Done
from services.code2wav import core as core_module
from services.code2wav.core import Code2WavCore
from services.code2wav.starts import START_BATCH, make_states
from services.code2wav.stream import CodecShape, DecodeStream
from tests.grpc_helpers import FakeIncrementalDecoder


class SlowStarts(FakeIncrementalDecoder):
    """Starts take 20 ms a batch, decode calls 2 ms; each call is logged in the worker's order.
    A prefix of `bad_len` frames fails its own stream."""

    def __init__(self, bad_len: int = -1, error: Exception | None = None):
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []
        self.bad_len, self.error = bad_len, error
        self._in_batch = False

    def start_many(self, prefixes):
        time.sleep(0.02)
        out = [
            self.error if p is not None and p.shape[0] == self.bad_len else self.start(p) for p in prefixes
        ]
        self.calls.append(("start", [id(s) for s in out]))
        return out

    def decode(self, state, codes):
        if not self._in_batch:
            self.calls.append(("decode", [id(state)]))
        return super().decode(state, codes)

    def decode_batch(self, states, codes):
        time.sleep(0.002)
        self.calls.append(("decode", [id(s) for s in states]))
        self._in_batch = True
        try:
            return super().decode_batch(states, codes)
        finally:
            self._in_batch = False


def _record_jobs(engine: Code2WavCore) -> list[tuple[str, str, int]]:
    """(event, kind, job) for each job handed to the worker: submitted, then ran, then done."""
    events: list[tuple[str, str, int]] = []
    seq = itertools.count()
    submit = engine._executor.submit

    def recording(fn, *args, **kwargs):
        target = getattr(fn, "func", fn)
        kind = {make_states: "start", core_module._decode_chunks: "decode"}.get(target, "other")
        job = next(seq)
        events.append(("submit", kind, job))

        def run(*a, **kw):
            events.append(("run", kind, job))
            try:
                return fn(*a, **kw)
            finally:
                events.append(("done", kind, job))

        return submit(run, *args, **kwargs)

    engine._executor.submit = recording
    return events


async def _until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.002)


def _feed(engine: Code2WavCore, stream: DecodeStream, n: int) -> None:
    stream.add_frames(stream.received_frames, np.ones((n, 16), dtype=np.int16))
    engine.notify(stream)


async def test_a_burst_of_opens_holds_each_decode_call_behind_at_most_one_batch_of_starts():
    decoder = SlowStarts()
    engine = Code2WavCore(
        decoder, Code2WavMetrics(CollectorRegistry()), plan=ChunkPlan(2, (2,)), max_states=64
    )
    events = _record_jobs(engine)
    await engine.start()
    stop = asyncio.Event()

    async def keep_playing(streams: list[DecodeStream]) -> None:
        # The listeners read everything; the talker keeps 2-4 frames queued.
        while not stop.is_set():
            for s in streams:
                s.ack(s.emitted_samples)
                if s.received_frames - s.decoded_frames < 4 and s.received_frames + 2 <= s.granted:
                    _feed(engine, s, 2)
            await asyncio.sleep(0.001)

    try:
        playing = [await engine.open_stream(name, 16) for name in ("a", "b")]
        feeder = asyncio.create_task(keep_playing(playing))
        await _until(lambda: all(s.decoded_frames >= 4 for s in playing), "a and b playing")
        burst_from = len(decoder.calls)
        prefix = np.ones((5, 16), dtype=np.int16)
        new = [await engine.open_stream(f"new{i}", 16, prefix_codes=prefix) for i in range(20)]
        for s in new:
            _feed(engine, s, 2)  # the first chunk waits for the state
        await _until(lambda: all(s.first_audio_at is not None for s in new), "every new stream heard")
        stop.set()
        await feeder
    finally:
        await engine.close()

    starts = [ids for kind, ids in decoder.calls[burst_from:] if kind == "start"]
    assert sum(len(ids) for ids in starts) == 20 and all(len(ids) <= START_BATCH for ids in starts)
    assert len(starts) < 20  # batched: 8, 8, 4 unless the drain found fewer queued
    # No decode call waited behind more than one batch of starts: at most one start job ended
    # between its submission and its run.
    ran = [job for event, kind, job in events if (event, kind) == ("run", "decode")]
    assert len(ran) > 2
    for job in ran:  # (a call submitted as close() cancels the loop never runs)
        begin = events.index(("submit", "decode", job))
        end = events.index(("run", "decode", job))
        assert sum(1 for e in events[begin:end] if e[:2] == ("done", "start")) <= 1
    # The playing streams were decoded between the burst's batches of starts, not after them all.
    worker = decoder.calls[burst_from:]
    first_start = next(i for i, (kind, _) in enumerate(worker) if kind == "start")
    last_start = max(i for i, (kind, _) in enumerate(worker) if kind == "start")
    playing_ids = {id(s.decoder_state) for s in playing}
    assert any(kind == "decode" and playing_ids & set(ids) for kind, ids in worker[first_start:last_start])


@pytest.mark.parametrize("device_failure", [False, True], ids=["error", "device-failure"])
async def test_a_start_error_fails_only_its_stream(device_failure):
    class DeviceGone(RuntimeError):
        pass

    decoder = SlowStarts(
        bad_len=3, error=DeviceGone("no device") if device_failure else GenerationFailed("bad")
    )
    engine = Code2WavCore(
        decoder,
        Code2WavMetrics(CollectorRegistry()),
        plan=ChunkPlan(2, (2,)),
        device_failure=lambda exc: isinstance(exc, DeviceGone),
    )
    await engine.start()
    try:
        streams = [
            await engine.open_stream(f"s{n}", 16, prefix_codes=np.ones((n, 16), dtype=np.int16))
            for n in (2, 3, 4)
        ]
        await _until(lambda: streams[0].started and streams[2].started, "the good states made")
        assert len(decoder.calls) == 1  # all three in one start job
        with pytest.raises(Unavailable if device_failure else GenerationFailed):
            async for _ in streams[1].events():
                pass
        assert [s.stream_id for s in engine.registry] == [streams[0].stream_id, streams[2].stream_id]
        for s in (streams[0], streams[2]):
            _feed(engine, s, 2)
            s.end(2)
            events = [e async for e in s.events()]
            assert isinstance(events[-1], Done) and events[-1].num_frames == 2
    finally:
        await engine.close()
    assert decoder.live == 0


async def test_the_slots_engine_serves_a_burst_of_prefix_streams_the_audio_of_one_stream_each():
    from qtts.decode_engine import SlotDecoderConfig, build_slot_decoder
    from qtts.model.codec_decoder import CodecDecoder, CodecDecoderConfig, init_dummy_weights
    from qtts.tiny_model.codec import TINY_DECODER_CONFIG

    codec = CodecDecoder(CodecDecoderConfig.from_dict(TINY_DECODER_CONFIG))
    init_dummy_weights(codec, 0)
    codec.eval()
    shape = CodecShape(codec.cfg.num_quantizers, codec.cfg.codebook_size, codec.samples_per_frame)
    rng = np.random.default_rng(7)
    ref = [rng.integers(0, shape.codebook_size, (n, 16)).astype(np.int16) for n in (30, 30, 6)]
    prefixes = [ref[0], ref[1], ref[2], None, ref[0]]  # two equal lengths, a short one, none, a repeat
    codes = [rng.integers(0, shape.codebook_size, (10, 16)).astype(np.int16) for _ in prefixes]
    engine_cfg = SlotDecoderConfig(max_streams=8, precision="fp32", cuda_graphs=False)
    decoder = build_slot_decoder(codec, engine_cfg)
    engine = Code2WavCore(
        decoder, Code2WavMetrics(CollectorRegistry()), codec_shape=shape, plan=ChunkPlan(2, (4,))
    )
    await engine.start()
    calls: list[int] = []
    start_many = decoder.start_many
    decoder.start_many = lambda ps: calls.append(len(ps)) or start_many(ps)
    try:
        streams = [await engine.open_stream(f"s{i}", 16, prefix_codes=p) for i, p in enumerate(prefixes)]
        for s, c in zip(streams, codes, strict=True):
            s.add_frames(0, c)
            s.end(len(c))
            engine.notify(s)
        pcm = []
        for s in streams:
            chunks = [e async for e in s.events() if isinstance(e, DecodedAudio)]
            pcm.append(np.frombuffer(b"".join(c.pcm_s16le for c in chunks), dtype="<i2").astype(np.int32))
    finally:
        await engine.close()
    assert calls == [5]  # one start job made all five states
    assert (decoder.prefix_hits, decoder.prefix_misses) == (1, 3)
    for p, c, got in zip(prefixes, codes, pcm, strict=True):
        full = codec.decode(torch.from_numpy(np.concatenate([p, c]) if p is not None else c).long())
        want = (full[(0 if p is None else len(p)) * shape.samples_per_frame :].clamp(-1, 1) * 32767).round()
        assert got.shape == want.shape and np.abs(got - want.numpy().astype(np.int32)).max() <= 2
    assert np.abs(pcm[0]).max() > 100 and decoder.num_live == 0


def test_make_states_falls_back_to_one_start_each_and_keeps_errors_per_stream():
    class NoBatch(FakeIncrementalDecoder):
        def start(self, prefix_codes=None):
            if prefix_codes is not None and prefix_codes.shape[0] == 3:
                raise GenerationFailed("bad prefix")
            return super().start(prefix_codes)

    decoder = NoBatch()
    prefixes = [None, np.ones((3, 16), np.int16), np.ones((4, 16), np.int16)]
    got = make_states(decoder, torch.device("cpu"), Code2WavMetrics(CollectorRegistry()), prefixes)
    assert got[0]["pos"] == 0 and isinstance(got[1], GenerationFailed) and got[2]["pos"] == 4
    assert decoder.live == 2


def test_a_job_takes_cheap_starts_beside_a_bounded_number_of_prefix_decodes():
    from types import SimpleNamespace

    from services.code2wav.starts import StateStarter, _Pending

    class Cached(FakeIncrementalDecoder):
        def prefix_cached(self, prefix):  # 5-frame prefixes are not cached
            return prefix.shape[0] != 5

    starter = StateStarter(
        Cached(), torch.device("cpu"), Code2WavMetrics(CollectorRegistry()), None, None, 2, 6
    )
    miss, hit = np.ones((5, 16), dtype=np.int16), np.ones((3, 16), dtype=np.int16)

    def queue(*prefixes, closed=()):
        for i, p in enumerate(prefixes):
            starter._queue.append(_Pending(SimpleNamespace(closed=i in closed, name=i), p))

    queue(miss, None, hit, miss, None, miss, None, closed={4})
    # Two decodes a job: the third miss waits, and nothing behind it jumps the queue.
    assert [p.stream.name for p in starter._take()] == [0, 1, 2, 3]
    assert [p.stream.name for p in starter._take()] == [5, 6]
    queue(*[None] * 8, hit)
    assert len(starter._take()) == 6 and len(starter._take()) == 3 and starter._take() == []
    # An engine without a prefix-state cache: every prefix costs a decode.
    plain = StateStarter(FakeIncrementalDecoder(), torch.device("cpu"), None, None, None, 2, 6)
    plain._queue.extend(_Pending(SimpleNamespace(closed=False), p) for p in (hit, None, hit, hit))
    assert len(plain._take()) == 3
    with pytest.raises(ValueError, match="batch <= most"):
        StateStarter(Cached(), torch.device("cpu"), None, None, None, 8, 4)


def test_the_slots_engine_says_which_prefixes_it_has_cached():
    from qtts.decode_engine import SlotDecoderConfig, build_slot_decoder
    from qtts.model.codec_decoder import CodecDecoder, CodecDecoderConfig, init_dummy_weights
    from qtts.tiny_model.codec import TINY_DECODER_CONFIG

    codec = CodecDecoder(CodecDecoderConfig.from_dict(TINY_DECODER_CONFIG))
    init_dummy_weights(codec, 0)
    decoder = build_slot_decoder(
        codec.eval(), SlotDecoderConfig(max_streams=2, precision="fp32", cuda_graphs=False)
    )
    rng = np.random.default_rng(3)
    seen, other = (rng.integers(0, codec.cfg.codebook_size, (6, 16)).astype(np.int16) for _ in range(2))
    assert not decoder.prefix_cached(seen)
    with torch.inference_mode():
        (state,) = decoder.start_many([torch.from_numpy(seen.astype(np.int64))])
    decoder.free(state)
    assert decoder.prefix_cached(seen) and not decoder.prefix_cached(other)
    assert not decoder.prefix_cached(seen[:5])  # a prefix of it is another prefix
