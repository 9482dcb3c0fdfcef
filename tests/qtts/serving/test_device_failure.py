"""A fatal device error in the talker's engine loop or code2wav's decode loop: health NOT_SERVING
(readiness and liveness) and the process exits non-zero; an ordinary error fails only its request.

CPU only: the error types are injected into the loops through a fake generator and decoder. The
exit itself is replaced here; tests/e2e/test_e2e_device_failure.py watches real processes exit.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qtts.pb import code2wav_pb2_grpc, tts_pb2
from qtts.request.errors import GenerationFailed
from qtts.serving.device_failure import DEVICE_FAILURE_EXIT_CODE, is_fatal_device_error
from qtts.serving.grpc_server import LIVENESS
from services.code2wav.config import Code2WavConfig
from services.code2wav.server import Code2WavServer
from tests.grpc_helpers import BidiClient, FakeIncrementalDecoder
from tests.services.code2wav.test_code2wav import _frames, _start
from tests.services.talker.fakes import FakeBundle, FakeCode2Wav, FakeGenerator, FakeSpec
from tests.services.talker.stack import eventually, generate_all, talker_stack

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


def test_what_counts_as_a_fatal_device_error():
    assert is_fatal_device_error(torch.AcceleratorError(ILLEGAL_ACCESS))
    assert is_fatal_device_error(RuntimeError(ILLEGAL_ACCESS))
    assert is_fatal_device_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"))
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as exc:
            raise GenerationFailed("generation step failed") from exc
    except GenerationFailed as wrapped:
        assert is_fatal_device_error(wrapped)  # found through the cause
    # The allocator recovers from these; a bad request is the request's own problem.
    assert not is_fatal_device_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not is_fatal_device_error(RuntimeError("CUDA error: out of memory"))
    assert not is_fatal_device_error(ValueError("temperature must be finite"))
    assert not is_fatal_device_error(RuntimeError("shape mismatch"))


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)).status


class FaultyGenerator(FakeGenerator):
    """A step with a request whose id starts with "bad" raises an ordinary error; "poison" a
    device error."""

    def step(self, skip=()) -> list:
        if any(rid.startswith("poison") for rid in self._active):
            raise torch.AcceleratorError(ILLEGAL_ACCESS)
        if any(rid.startswith("bad") for rid in self._active):
            raise ValueError("a shape this step cannot take")
        return super().step(skip)


CLONE = dict(
    task_type=tts_pb2.TASK_TYPE_VOICE_CLONE,
    reference_pcm_f32=(np.sin(np.arange(2400) / 10) * 0.3).astype("<f4").tobytes(),
    x_vector_only=True,
)


async def test_talker_device_error_fails_streams_unavailable_turns_not_serving_and_exits():
    exits: list[int] = []
    async with talker_stack(
        [FakeCode2Wav("c2w-a")],
        bundle=FakeBundle(),
        generator_factory=FaultyGenerator,
        spec_factory=FakeSpec,
        exit_process=exits.append,
    ) as s:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{s.talker.host.bound_port}")
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await generate_all(s.stub, request_id="bad-1", text="frames=3", **CLONE)
        assert bad.value.code() != grpc.StatusCode.UNAVAILABLE
        chunks, summary = await generate_all(s.stub, request_id="ok-1", text="frames=3", **CLONE)
        assert summary.num_frames == 3
        assert await _health(channel) == SERVING and exits == []

        with pytest.raises(grpc.aio.AioRpcError) as dead:
            await generate_all(s.stub, request_id="poison-1", text="frames=3", **CLONE)
        assert dead.value.code() == grpc.StatusCode.UNAVAILABLE, dead.value
        await eventually(lambda: exits == [DEVICE_FAILURE_EXIT_CODE], timeout=5)
        assert await _health(channel) == NOT_SERVING
        assert await _health(channel, LIVENESS) == NOT_SERVING
        assert s.talker.device_failure.failed
        # The ring changing later must not bring a dead talker back to SERVING.
        s.talker.replicas.mark_down(s.replicas[0].address, "test")
        s.talker.replicas.mark_up(s.replicas[0].address)
        await asyncio.sleep(0.1)
        assert await _health(channel) == NOT_SERVING
        await channel.close()


class FaultyDecoder(FakeIncrementalDecoder):
    """Raises `fault` from decode once set (warm-up decodes before it is)."""

    fault: BaseException | None = None

    def decode(self, state, codes):
        if self.fault is not None:
            raise self.fault
        return super().decode(state, codes)


async def _decode_until_error(stub) -> grpc.aio.AioRpcError:
    client = BidiClient(stub.Decode)
    client.send(_start(first_chunk_frames=2))
    codes = np.zeros((4, 16), dtype=np.int16)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while (msg := await client.read()) is not None:
            if msg.WhichOneof("event") == "credit":
                client.send(_frames(0, codes))
    return info.value


@pytest.mark.parametrize("fatal", [True, False], ids=["device-error", "ordinary-error"])
async def test_code2wav_device_error_turns_not_serving_and_exits(fatal):
    exits: list[int] = []
    decoder = FaultyDecoder()
    config = Code2WavConfig(port=0, metrics_port=0, drain_seconds=0.5, replica_name="r").validate()
    server = Code2WavServer(config, decoder=decoder, exit_process=exits.append)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = code2wav_pb2_grpc.Code2WavServiceStub(channel)
            decoder.fault = torch.AcceleratorError(ILLEGAL_ACCESS) if fatal else ValueError("bad codes")
            error = await _decode_until_error(stub)
            if fatal:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                await eventually(lambda: exits == [DEVICE_FAILURE_EXIT_CODE], timeout=5)
                assert await _health(channel) == NOT_SERVING
                assert await _health(channel, LIVENESS) == NOT_SERVING
            else:
                assert error.code() != grpc.StatusCode.UNAVAILABLE, error
                await asyncio.sleep(0.6)  # longer than the exit's flush delay
                assert exits == [] and await _health(channel) == SERVING
                assert await _health(channel, LIVENESS) == SERVING
    finally:
        await server.stop(0.5)


@pytest.mark.parametrize("fatal", [True, False], ids=["device-error", "ordinary-error"])
def test_a_device_error_in_the_warm_up_ends_the_start_an_ordinary_one_does_not(fatal):
    from services.talker.warmup import warm_up

    class Failing(FakeGenerator):
        def step(self, skip=()):
            raise torch.AcceleratorError(ILLEGAL_ACCESS) if fatal else ValueError("a lazy init that failed")

    bundle = FakeBundle("custom_voice")
    bundle.build_prompt = lambda spec: FakeBundle.build_prompt(bundle, FakeSpec(text="frames=2", task="x"))
    if fatal:
        with pytest.raises(torch.AcceleratorError):
            warm_up(bundle, Failing())
    else:
        assert warm_up(bundle, Failing()) is False  # serves without the warm-up
