"""Health of the stages the gateway needs (talker, speaker_cache), through grpc.health.v1."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class StageHealth:
    """Checks each downstream stage's overall health; the gateway is healthy only if all serve.

    The talker reports itself NOT_SERVING when no code2wav replica is reachable, so code2wav is
    covered through it. With a talker pool, the talker's status is the pool's (`serving`).
    """

    def __init__(
        self,
        stages: dict[str, grpc.aio.Channel],
        timeout: float = 1.0,
        serving: dict[str, Callable[[], Awaitable[bool]]] | None = None,
    ):
        """`serving`: stages whose status comes from the client that calls them rather than from a
        health check over `stages`' channel (the talker pool: readiness is whether a new stream
        would find a talker); they answer SERVING or NOT_SERVING."""
        self._stubs = {name: health_pb2_grpc.HealthStub(ch) for name, ch in stages.items()}
        self._serving = dict(serving or {})
        self._timeout = timeout

    async def _check(self, stub: health_pb2_grpc.HealthStub) -> str:
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            return f"UNREACHABLE ({exc.code().name})"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def _ask(self, name: str) -> str:
        if name in self._serving:
            return "SERVING" if await self._serving[name]() else "NOT_SERVING"
        return await self._check(self._stubs[name])

    async def check(self) -> dict[str, str]:
        """Status name per stage ("SERVING", "NOT_SERVING", "UNREACHABLE (...)")."""
        names = [*self._serving, *self._stubs]
        statuses = await asyncio.gather(*(self._ask(n) for n in names))
        return dict(zip(names, statuses, strict=True))
