"""Per-client request rate: a token bucket per client key (API key, else address).

`StreamLimits` (stream_limits.py) bounds what a client holds at once (concurrent streams); this
bounds how often it may ask, so a client cannot keep the gateway busy with a flood of cheap or refused requests either.
Each client may send `burst` requests at once and `rate_per_s` a second after that; one more is a
429 with `Retry-After` (HTTP) or RESOURCE_EXHAUSTED with `retry-after` / `grpc-retry-pushback-ms`
(gRPC), answered before the request body is read or the call's request is looked at.

Only the public API counts (HTTP `/v1/`, the tts.v1 RPCs): health probes, metrics, the
playground page and its static files never do. A bucket that has refilled is the same as a new
one, so the table forgets full buckets first and holds at most `max_clients` keys.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from qtts.request.errors import ResourceExhausted, openai_error_body, retry_headers

from .client_identity import current_client, grpc_client_key


class RateLimiter:
    """Token buckets by client key; `check()` takes a token or raises ResourceExhausted."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        max_clients: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        if rate_per_s <= 0 or burst < 1 or max_clients < 1:
            raise ValueError("rate_per_s must be > 0, burst and max_clients >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_clients = max_clients
        self._clock = clock
        # client -> (tokens, at): the tokens it had at that time; least recently seen first.
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, client: str) -> None:
        now = self._clock()
        tokens, at = self._buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate_per_s)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            wait_s = max(1, math.ceil((1.0 - tokens) / self.rate_per_s))
            raise ResourceExhausted(
                f"this client is over its rate limit of {self.rate_per_s:g} requests a second "
                f"(bursts of {self.burst}); retry in {wait_s} s",
                retry_after_s=wait_s,
            )
        self._buckets[client] = (tokens - 1.0, now)
        if len(self._buckets) > self.max_clients:
            self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop the buckets that have refilled, then (a flood of keys) the least recently seen."""
        full_after_s = self.burst / self.rate_per_s
        for client in [c for c, (_, at) in self._buckets.items() if now - at >= full_after_s]:
            del self._buckets[client]
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)


def _counted(path: str) -> bool:
    return path.startswith("/v1/")


class RateLimitMiddleware:
    """A pure ASGI middleware: a 429 for an HTTP `/v1/` request or WebSocket handshake of a client
    over its rate. It runs inside ClientIdentityMiddleware (the client key is bound) and before
    the body is read (the WebSocket is accepted)."""

    def __init__(self, app: Any, limiter: RateLimiter):
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and _counted(scope.get("path", "")):
            try:
                self.limiter.check(current_client())
            except ResourceExhausted as exc:
                if scope["type"] == "http" or "websocket.http.response" in scope.get("extensions", {}):
                    await _refuse(send, exc, prefix="websocket." if scope["type"] == "websocket" else "")
                else:  # the handshake is answered with 403
                    await send({"type": "websocket.close", "code": 1008, "reason": "rate_limit_exceeded"})
                return
        await self.app(scope, receive, send)


async def _refuse(send: Any, exc: ResourceExhausted, prefix: str = "") -> None:
    """The 429 (`prefix` "websocket.": as the answer to a WebSocket handshake)."""
    body = json.dumps(openai_error_body(exc)).encode()
    await send(
        {
            "type": f"{prefix}http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *((k.lower().encode(), v.encode()) for k, v in retry_headers(exc.retry_after_s).items()),
            ],
        }
    )
    await send({"type": f"{prefix}http.response.body", "body": body})


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    """Takes a token for every call to `services` before its handler runs; a client over its rate
    gets RESOURCE_EXHAUSTED (mapped, with its pushback, by the ErrorMappingInterceptor)."""

    def __init__(self, limiter: RateLimiter, services: Iterable[str], keys_enabled: bool = False):
        self.limiter = limiter
        self.keys_enabled = keys_enabled
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._limited(handler.unary_unary), des, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._limited(handler.stream_unary), des, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._limited(handler.unary_stream), des, ser)
        return grpc.stream_stream_rpc_method_handler(self._limited(handler.stream_stream), des, ser)

    def _limited(self, behavior: Callable) -> Callable:
        # The client key needs the call's peer, which only the handler's context knows.
        if inspect.isasyncgenfunction(behavior):

            async def limited_stream(request: Any, context: grpc.aio.ServicerContext):
                self.limiter.check(grpc_client_key(context, self.keys_enabled))
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response

            return limited_stream

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.limiter.check(grpc_client_key(context, self.keys_enabled))
            return await behavior(request, context)

        return limited
