"""Every service counts and times its gRPC calls by method and final code (tts_rpc_*) and exports
process_* metrics on its own registry."""

from __future__ import annotations

import asyncio
import time

import grpc
from prometheus_client import CollectorRegistry

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.errors import InvalidArgument
from qtts.serving.grpc_server import GrpcServiceHost, service_full_name
from qtts.serving.metrics import TalkerMetrics

INFO = "/talker.v1.TalkerService/GetModelInfo"
GENERATE = "/talker.v1.TalkerService/Generate"


class Servicer(talker_pb2_grpc.TalkerServiceServicer):
    async def GetModelInfo(self, request, context):
        return talker_pb2.GetModelInfoResponse(name="m")

    async def Generate(self, request, context):
        if request.text == "bad":
            raise InvalidArgument("bad text")
        for i in range(request.max_new_frames):
            await asyncio.sleep(0.01 if request.text == "slow" else 0)
            yield talker_pb2.GenerateResponse(
                request_id=request.request_id, sequence_number=i, audio=tts_pb2.AudioChunk(audio=b"\0\0")
            )


async def started_host() -> tuple[TalkerMetrics, GrpcServiceHost]:
    """A serving host of `Servicer` on a free port, with its metrics."""
    metrics = TalkerMetrics(CollectorRegistry())
    host = GrpcServiceHost(
        service_names=[service_full_name(talker_pb2, "TalkerService")], metrics=metrics, port=0
    )
    talker_pb2_grpc.add_TalkerServiceServicer_to_server(Servicer(), host.server)
    await host.start()
    await host.set_serving()
    return metrics, host


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_calls_are_counted_and_timed_by_method_and_code():
    metrics, host = await started_host()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.bound_port}") as channel:
            stub = talker_pb2_grpc.TalkerServiceStub(channel)
            await stub.GetModelInfo(talker_pb2.GetModelInfoRequest())
            assert (
                len([m async for m in stub.Generate(talker_pb2.GenerateRequest(text="ok", max_new_frames=3))])
                == 3
            )
            try:
                async for _ in stub.Generate(talker_pb2.GenerateRequest(text="bad", max_new_frames=3)):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            call = stub.Generate(talker_pb2.GenerateRequest(text="slow", max_new_frames=1000))
            await call.read()
            call.cancel()
        r = metrics.registry
        for _ in range(100):
            if sample(r, "tts_rpc_requests_total", service="talker", method=GENERATE, code="CANCELLED"):
                break
            await asyncio.sleep(0.02)
        assert sample(r, "tts_rpc_requests_total", service="talker", method=INFO, code="OK") == 1
        assert sample(r, "tts_rpc_requests_total", service="talker", method=GENERATE, code="OK") == 1
        assert (
            sample(r, "tts_rpc_requests_total", service="talker", method=GENERATE, code="INVALID_ARGUMENT")
            == 1
        )
        assert sample(r, "tts_rpc_requests_total", service="talker", method=GENERATE, code="CANCELLED") == 1
        assert sample(r, "tts_rpc_duration_seconds_count", service="talker", method=GENERATE) == 3
        assert sample(r, "tts_errors_total", service="talker", code="INVALID_ARGUMENT") == 1
        assert sample(r, "process_cpu_seconds_total") > 0
        assert sample(r, "process_resident_memory_bytes") > 0
    finally:
        await host.stop(0)


async def test_a_call_from_another_service_times_its_wait_before_the_handler():
    from qtts.serving.log_context import SENT_AT_KEY, outgoing_metadata, waited_since_sent

    metrics, host = await started_host()
    labels = {"service": "talker", "method": INFO}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{host.bound_port}") as channel:
            stub = talker_pb2_grpc.TalkerServiceStub(channel)
            await stub.GetModelInfo(talker_pb2.GetModelInfoRequest())  # a client that does not say
            assert sample(metrics.registry, "tts_rpc_accept_seconds_count", **labels) == 0
            await stub.GetModelInfo(talker_pb2.GetModelInfoRequest(), metadata=outgoing_metadata("r1"))
            # Sent 2 s ago by the caller's clock: the wait counts from then.
            old = (*outgoing_metadata("r2")[:-1], (SENT_AT_KEY, str(time.time_ns() - 2_000_000_000)))
            await stub.GetModelInfo(talker_pb2.GetModelInfoRequest(), metadata=old)
    finally:
        await host.stop(0)
    assert sample(metrics.registry, "tts_rpc_accept_seconds_count", **labels) == 2
    assert 2.0 <= sample(metrics.registry, "tts_rpc_accept_seconds_sum", **labels) < 3.0
    assert waited_since_sent([(SENT_AT_KEY, "100")], now_ns=50) == 0.0  # a clock behind: not below 0
    assert waited_since_sent([(SENT_AT_KEY, "-5")]) is None and waited_since_sent(()) is None
