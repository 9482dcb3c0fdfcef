"""The talker's capacity through real gRPC servers: code2wav's published decode cost reaches
admission when the decoder shares the GPU, and GetCapacity says how many more requests it takes."""

from __future__ import annotations

import asyncio

import pytest

from qtts.pb import talker_pb2
from services.talker.code2wav_client import DecoderCosts
from tests.services.talker.fakes import FakeBundle, FakeCode2Wav, FakeGenerator, FakeSpec
from tests.services.talker.stack import eventually, generate_all, talker_stack
from tests.services.talker.test_talker_service import CLONE


def stack(replicas, **kw):
    return talker_stack(
        replicas, bundle=FakeBundle("base"), generator_factory=FakeGenerator, spec_factory=FakeSpec, **kw
    )


def admission(s):
    return s.talker.engine._scheduler.admission


@pytest.mark.parametrize("shares", [True, False])
async def test_the_decoder_s_published_cost_reaches_admission_only_on_a_shared_gpu(shares):
    replica = FakeCode2Wav("c2w-a", cost=(30_000, 2_000_000, 10.0))  # 30 us a frame, 2 ms a call
    async with stack([replica], decoder_shares_gpu=shares, decoder_frame_us=20.0) as s:
        await generate_all(s.stub, request_id="r1", text="frames=5", **CLONE)
        adm = admission(s)
        if shares:
            await eventually(lambda: adm.decoder_measured)
            assert adm.decoder_frame_s == pytest.approx(30e-6)
            assert adm.decoder_call_load == pytest.approx(0.002 * 10.0)
        else:
            assert not adm.decoder_measured and adm.decoder_frame_s == pytest.approx(20e-6)


def test_replicas_on_one_gpu_add_their_call_costs_and_the_engine_hears_at_most_every_interval():
    heard, now = [], [0.0]
    costs = DecoderCosts(lambda *a: heard.append(a), min_interval_s=0.25, clock=lambda: now[0])
    costs.observe("a", 30e-6, 0.002, 10.0)
    costs.observe("b", 40e-6, 0.001, 5.0)  # within the interval: kept, not sent
    costs.observe("c", 0.0, 0.0, 0.0)  # not measured yet: ignored
    assert heard == [(30e-6, pytest.approx(0.02), 1.0)]
    now[0] = 0.3
    costs.observe("a", 30e-6, 0.002, 10.0)
    assert heard[-1] == (40e-6, pytest.approx(0.025), 1.0)


async def test_get_capacity_says_what_the_talker_takes_and_when_to_retry():
    async with stack([FakeCode2Wav("c2w-a")], max_batch=1, max_queue=0) as s:
        idle = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest())
        assert (idle.start_now, idle.accept, idle.running, idle.waiting) == (1, 1, 0, 0)
        call = s.stub.Generate(talker_pb2.GenerateRequest(request_id="a", text="frames=100000 slow", **CLONE))
        await call.read()
        full = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest())
        assert (full.start_now, full.accept, full.running) == (0, 0, 1)
        assert full.retry_after_s >= 1
        call.cancel()
        await eventually(lambda: s.generator.num_active == 0)


async def test_capacity_crosses_from_the_engine_process_and_decoder_costs_go_to_it(tiny_snapshot):
    """GetCapacity is answered by the engine process's scheduler; the decoder's cost messages go
    down the same pipe (what admission does with them is tested in one process above)."""
    replica = FakeCode2Wav("c2w-a", cost=(30_000, 2_000_000, 10.0))
    async with talker_stack(
        [replica],
        bundle=None,
        model=str(tiny_snapshot("custom_voice")),
        engine_process="on",
        max_batch=1,
        max_queue=0,
        decoder_shares_gpu=True,
    ) as s:
        idle = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest())
        assert (idle.start_now, idle.accept) == (1, 1)
        first = s.stub.Generate(
            talker_pb2.GenerateRequest(
                request_id="a", text="Hello world.", voice="vivian", max_new_frames=400
            )
        )
        assert (await first.read()).WhichOneof("event") == "audio"  # a grant with the cost came first
        full = await s.stub.GetCapacity(talker_pb2.GetCapacityRequest())
        assert (full.start_now, full.accept, full.running) == (0, 0, 1) and full.retry_after_s >= 1
        held = await asyncio.to_thread(s.talker.engine_client.call, "held", timeout=10)
        assert held is not None  # the pipe is in order: the cost went before this call's answer
        first.cancel()
