"""`--code2wav-stall-timeout-s`: a code2wav replica that hangs (while its connection, keepalive
pings and health checks still answer) fails or moves the streams waiting on it, and leaves the ring.

The replicas are real in-process grpc.aio servers; the model core is the fake of
`test_talker_service.py`.
"""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import grpc
import pytest

from qtts.pb import code2wav_pb2, talker_pb2
from qtts.request.vocabulary import AudioPiece, SynthesisSummary
from qtts.streams.hash_ring import HashRing
from services.talker.config import TalkerConfig, config_from_args
from services.talker.replicas import Code2WavReplicas
from services.talker.request import GenerationRequest
from tests.services.talker.fakes import FakeCode2Wav
from tests.services.talker.stack import eventually, generate_all
from tests.services.talker.test_talker_service import CLONE, fake_stack

STALL_S = 0.5


class HungCode2Wav(FakeCode2Wav):
    """A replica whose decoder hung: it reads the stream but answers nothing after the first
    `grant` frames of credit (none with `grant=0`). Its health service still reports SERVING."""

    def __init__(self, name: str, grant: int = 4):
        super().__init__(name)
        self.grant = grant
        self.received = 0

    async def Decode(self, request_iterator, context):  # noqa: N802
        self.live += 1
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("event")
                if kind == "start" and self.grant:
                    yield code2wav_pb2.DecodeResponse(
                        credit=code2wav_pb2.CreditGrant(frames_allowed_until=self.grant)
                    )
                elif kind == "frames":
                    self.received += req.frames.num_frames
        finally:
            self.live -= 1


async def within(coro, timeout_s: float = 10.0):
    """`coro`'s result; a stall that is never detected fails the test instead of hanging it."""
    return await asyncio.wait_for(coro, timeout_s)


def keys_on(ring_addresses: list[str], vnodes: int, address: str, n: int = 1) -> list[str]:
    ring = HashRing(ring_addresses, vnodes=vnodes)
    return [k for k in (f"r{i}" for i in range(1000)) if ring.get(k) == address][:n]


def errors(s, code: str) -> float:
    return (
        s.talker.metrics.registry.get_sample_value("tts_errors_total", {"service": "talker", "code": code})
        or 0
    )


def stall_stack(replicas, **kw):
    return fake_stack(replicas, code2wav_stall_timeout_s=STALL_S, health_interval_s=60.0, **kw)


async def test_a_hung_replica_fails_its_stream_frees_the_slot_and_leaves_the_ring():
    hung, healthy = HungCode2Wav("c2w-hung", grant=4), FakeCode2Wav("c2w-ok")
    async with stall_stack([hung, healthy], credit_window_frames=3) as s:
        a, b = s.replicas
        vnodes = s.talker.config.ring_vnodes
        [on_hung] = keys_on([a.address, b.address], vnodes, a.address)
        [on_healthy] = keys_on([a.address, b.address], vnodes, b.address)
        # A stream on the healthy replica that outlives the stall of the other one.
        other = asyncio.create_task(
            generate_all(s.stub, request_id=on_healthy, text="frames=150 slow", **CLONE)
        )
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await within(generate_all(s.stub, request_id=on_hung, text="frames=100000", **CLONE))
        waited = time.monotonic() - started
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        assert f"code2wav replica {a.address} stalled" in details and "frames wait for credit" in details
        assert STALL_S <= waited < STALL_S + 5.0
        # What the replica granted was sent; then the talker stopped generating at its window.
        assert hung.received == 4
        # The stream's generator slot, its scheduler entry and its Decode call are gone.
        await eventually(lambda: on_hung not in s.generator._active and hung.live == 0)
        assert errors(s, "UNAVAILABLE") == 1
        # The hung replica still passes health checks, but it stays off the ring.
        assert s.talker.replicas.healthy == {b.address}
        await s.talker.replicas.check_all()
        assert s.talker.replicas.healthy == {b.address}
        chunks, summary = await other
        assert summary.code2wav_replica == "c2w-ok" and summary.num_frames == 150
        assert sum(c.num_samples for c in chunks) == 150 * 1920
        # New streams keyed to the hung replica go to the healthy one.
        _, summary = await generate_all(s.stub, request_id=on_hung, text="frames=3", **CLONE)
        assert summary.code2wav_replica == "c2w-ok"
        await eventually(lambda: s.generator.num_active == 0 and s.talker.engine.counts() == (0, 0))
        assert s.gauge("tts_talker_active_streams") == 0


async def test_a_stream_the_hung_replica_never_answered_moves_to_the_next_replica():
    hung, healthy = HungCode2Wav("c2w-hung", grant=0), FakeCode2Wav("c2w-ok")
    async with stall_stack([hung, healthy]) as s:
        a, b = s.replicas
        [on_hung] = keys_on([a.address, b.address], s.talker.config.ring_vnodes, a.address)
        chunks, summary = await within(generate_all(s.stub, request_id=on_hung, text="frames=20", **CLONE))
        assert summary.code2wav_replica == "c2w-ok" and summary.num_frames == 20
        assert sum(c.num_samples for c in chunks) == 20 * 1920
        assert healthy.logs[0].frames == list(range(20)) and healthy.logs[0].violations == []
        assert s.talker.replicas.healthy == {b.address}
        await eventually(lambda: hung.live == 0 and s.generator.num_active == 0)
        assert errors(s, "UNAVAILABLE") == 0


async def test_with_no_other_replica_the_error_names_the_stall():
    hung = HungCode2Wav("c2w-hung", grant=0)
    async with stall_stack([hung]) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await within(generate_all(s.stub, request_id="r", text="frames=20", **CLONE))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"code2wav replica {s.replicas[0].address} stalled" in err.value.details()
        await eventually(lambda: hung.live == 0 and s.generator.num_active == 0)
        assert s.talker.engine.counts() == (0, 0)


async def test_a_replica_that_hangs_after_stream_end_fails_the_stream():
    class HangsAtEnd(FakeCode2Wav):
        """Decodes the frames, then never sends StreamDone."""

        async def Decode(self, request_iterator, context):  # noqa: N802
            async def until_end():
                async for req in request_iterator:
                    if req.WhichOneof("event") == "end":
                        await asyncio.sleep(3600)
                    yield req

            async for msg in super().Decode(until_end(), context):
                yield msg

    c2w = HangsAtEnd("c2w-a", window=100)
    async with stall_stack([c2w]) as s:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await within(generate_all(s.stub, request_id="r", text="frames=5", **CLONE))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stalled" in err.value.details() and "end of the stream" in err.value.details()
        await eventually(lambda: c2w.live == 0 and s.generator.num_active == 0)


async def test_a_listener_slower_than_the_timeout_is_not_a_stall():
    # The replica grants credit only as the listener acknowledges audio: while the caller sits on a
    # chunk, the stream waits on its listener, not on the replica.
    c2w = FakeCode2Wav("c2w-a", window=2)
    async with stall_stack([c2w], credit_window_frames=2) as s:
        req = GenerationRequest(
            request_id="slow-reader",
            text="frames=12",
            reference_pcm_f32=CLONE["reference_pcm_f32"],
            reference_text=CLONE["reference_text"],
        )
        items = []
        async for item in s.talker.core.generate(req):
            items.append(item)
            if len(items) == 1:
                await asyncio.sleep(3 * STALL_S)
        assert isinstance(items[-1], SynthesisSummary) and items[-1].num_frames == 12
        assert sum(i.num_samples for i in items if isinstance(i, AudioPiece)) == 12 * 1920
        assert s.talker.replicas.healthy == {s.replicas[0].address}


async def test_zero_turns_the_stall_timeout_off():
    hung = HungCode2Wav("c2w-hung", grant=4)
    async with fake_stack([hung], code2wav_stall_timeout_s=0.0, health_interval_s=60.0) as s:
        call = s.stub.Generate(talker_pb2.GenerateRequest(request_id="held", text="frames=100000", **CLONE))
        reading = asyncio.ensure_future(call.read())
        await asyncio.sleep(1.0)
        assert not reading.done() and "held" in s.generator._active
        assert s.talker.replicas.healthy == {s.replicas[0].address}
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0 and hung.live == 0)


def test_stall_holds_double_while_a_replica_keeps_stalling_and_reset_once_it_completes_a_stream():
    replicas = Code2WavReplicas(["a:1", "b:1"], stall_hold_s=0.2, channel_factory=lambda _: mock.MagicMock())
    replicas.mark_stalled("a:1", "stalled")
    replicas.mark_stalled("a:1", "stalled")  # a second stream of the same hang
    assert replicas.healthy == {"b:1"} and replicas.held("a:1")
    replicas.mark_up("a:1")  # a health check that passes
    assert replicas.healthy == {"b:1"}
    time.sleep(0.3)
    replicas.mark_up("a:1")
    assert replicas.healthy == {"a:1", "b:1"}
    replicas.mark_stalled("a:1", "stalled again")  # held 0.4 s now
    time.sleep(0.3)
    assert replicas.held("a:1")
    time.sleep(0.2)
    assert not replicas.held("a:1")
    replicas.stream_completed("a:1")
    replicas.mark_stalled("a:1", "stalled after a good stream")  # back to 0.2 s
    time.sleep(0.3)
    assert not replicas.held("a:1")


def test_stall_timeout_flag_env_and_validation(monkeypatch, capsys):
    assert config_from_args([]).code2wav_stall_timeout_s == TalkerConfig().code2wav_stall_timeout_s == 30.0
    assert config_from_args(["--code2wav-stall-timeout-s", "0"]).code2wav_stall_timeout_s == 0.0
    monkeypatch.setenv("TTS_TALKER_CODE2WAV_STALL_TIMEOUT_S", "7.5")
    assert config_from_args([]).code2wav_stall_timeout_s == 7.5
    with pytest.raises(SystemExit):
        config_from_args(["--code2wav-stall-timeout-s", "-1"])
    assert "--code2wav-stall-timeout-s must be >= 0" in capsys.readouterr().err
