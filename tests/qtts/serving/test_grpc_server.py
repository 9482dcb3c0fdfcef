"""GrpcServiceHost through a real server: health, reflection, error mapping, metrics, drain."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from qtts.request.errors import NotFound, ResourceExhausted
from qtts.serving.metrics import ServiceMetrics

SERVICE = "test.v1.EchoService"


def _identity(b: bytes) -> bytes:
    return b


class _Echo:
    """A service without protos: raw bytes in and out."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def echo(self, request: bytes, context) -> bytes:
        if request == b"missing":
            raise NotFound("no such thing")
        if request == b"boom":
            raise RuntimeError("unexpected")
        if request == b"abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "handler aborted")
        return request

    async def stream(self, request: bytes, context):
        for i in range(3):
            if request == b"full" and i == 1:
                raise ResourceExhausted("too many")
            yield bytes([i])

    async def slow(self, request: bytes, context) -> bytes:
        self.started.set()
        await self.release.wait()
        return b"done"


def _register(echo: _Echo):
    def register(server: grpc.aio.Server) -> None:
        handlers = {
            "Echo": grpc.unary_unary_rpc_method_handler(echo.echo, _identity, _identity),
            "Stream": grpc.unary_stream_rpc_method_handler(echo.stream, _identity, _identity),
            "Slow": grpc.unary_unary_rpc_method_handler(echo.slow, _identity, _identity),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    return register


def _call(channel: grpc.aio.Channel, method: str, streaming: bool = False):
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity)


async def test_health_not_serving_until_set_serving(grpc_host_factory):
    async with grpc_host_factory(_register(_Echo()), [SERVICE], serving=False) as (host, channel):
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await host.set_serving()
        for name in ("", SERVICE):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_services(grpc_host_factory):
    async with grpc_host_factory(_register(_Echo()), [SERVICE]) as (_, channel):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = set()
        async for resp in responses:
            names = {s.name for s in resp.list_services_response.service}
            break
        assert SERVICE in names
        assert "grpc.health.v1.Health" in names


async def test_domain_errors_map_to_status_codes_and_are_counted(grpc_host_factory):
    metrics = ServiceMetrics(CollectorRegistry(), "test")
    async with grpc_host_factory(_register(_Echo()), [SERVICE], metrics) as (_, channel):
        assert await _call(channel, "Echo")(b"hi") == b"hi"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _call(channel, "Echo")(b"missing")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "no such thing"

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _call(channel, "Echo")(b"boom")
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "unexpected" not in err.value.details()

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _call(channel, "Echo")(b"abort")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # The server survives an unexpected exception.
        assert await _call(channel, "Echo")(b"again") == b"again"

        call = _call(channel, "Stream", streaming=True)(b"full")
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in call:
                received.append(item)
        assert received == [b"\x00"]
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    def count(code: str) -> float:
        return metrics.registry.get_sample_value("tts_errors_total", {"service": "test", "code": code})

    assert count("NOT_FOUND") == 1
    assert count("INTERNAL") == 1
    assert count("RESOURCE_EXHAUSTED") == 1
    assert count("FAILED_PRECONDITION") == 1


async def test_metrics_endpoint_serves_the_service_registry(grpc_host_factory, free_tcp_port):
    metrics = ServiceMetrics(CollectorRegistry(), "test")
    metrics.observe_stage("unit", 0.01)
    async with grpc_host_factory(_register(_Echo()), [SERVICE], metrics, metrics_port=free_tcp_port) as (
        host,
        _,
    ):
        url = f"http://127.0.0.1:{host.bound_metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'tts_stage_latency_seconds_count{service="test",stage="unit"} 1.0' in body


async def test_drain_finishes_in_flight_rpcs_and_refuses_new_ones(grpc_host_factory):
    echo = _Echo()
    async with grpc_host_factory(_register(echo), [SERVICE], drain_seconds=10.0) as (host, channel):
        in_flight = asyncio.ensure_future(_call(channel, "Slow")(b""))
        await echo.started.wait()
        host.request_stop()
        drained = asyncio.ensure_future(host.serve_until_signal())
        # Health flips before the in-flight call completes.
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):
            try:
                resp = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.aio.AioRpcError:
                break  # already refusing new RPCs
            if resp.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("health never left SERVING during the drain")
        echo.release.set()
        assert await in_flight == b"done"
        await drained
        with pytest.raises(grpc.aio.AioRpcError):
            await _call(channel, "Echo")(b"late", timeout=1)
