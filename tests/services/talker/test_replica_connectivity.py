"""A dead code2wav replica is told from a slow one by its connection (Code2WavReplicas' watch), with
real gRPC servers on loopback: a server that goes away is off the ring and `lost` within a second,
without a periodic round; back on its port, it is on the ring again; a server that answers its
health checks too late is taken off the ring by the periodic round but never called lost."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.talker.replicas import Code2WavReplicas


class _Health(health_pb2_grpc.HealthServicer):
    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def Check(self, request, context):  # noqa: N802 - gRPC method name
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _serve(port: int = 0, delay_s: float = 0.0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(_Health(delay_s), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def _until(condition, timeout_s: float) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not condition():
        assert loop.time() - started < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.01)
    return loop.time() - started


async def test_a_replica_that_goes_away_is_lost_within_a_second_and_back_when_it_listens():
    server, port = await _serve()
    changes: list[bool] = []
    # No periodic round within the test: only the connectivity watch can notice.
    replicas = Code2WavReplicas([f"127.0.0.1:{port}"], health_interval_s=60, on_availability=changes.append)
    replicas.start()
    try:
        await replicas.check_all()
        await _until(lambda: replicas.healthy, 5)
        await asyncio.sleep(0.2)  # the watch has seen the connection READY
        await server.stop(None)
        assert await _until(lambda: not replicas.healthy, 1.0) < 1.0
        assert replicas.all_lost and changes == [False]
        server, _ = await _serve(port)
        await _until(lambda: replicas.healthy, 5)
        assert not replicas.all_lost and changes == [False, True]
    finally:
        await replicas.close()
        await server.stop(None)


async def test_a_replica_that_answers_late_is_not_taken_for_a_dead_one():
    server, port = await _serve(delay_s=2.0)
    replicas = Code2WavReplicas([f"127.0.0.1:{port}"], health_interval_s=0.2)
    replicas.start()
    try:
        await _until(lambda: not replicas.healthy, 5)  # the periodic round's 1 s deadline
        await asyncio.sleep(1.5)
        assert not replicas.all_lost
    finally:
        await replicas.close()
        await server.stop(None)
