"""Limits on what one HTTP client can hold of the gateway: the body size, how slowly a request may
arrive, and how long a response may wait for a client that reads nothing.

- `BodyLimitMiddleware`: a `Content-Length` above the limit is a 413 before any of the body is
  read; a chunked body is counted as it arrives and refused once it passes the limit, so no body
  larger than the limit is ever held in memory. A body that stalls for `body_timeout_s` between
  two pieces is a 408, and so is one not complete `body_deadline_s` after its request began (one
  byte every 20 s never stalls, and held a request open for good).
- `header_timeout_protocol`: uvicorn closes idle keep-alive connections, but not a connection that
  never finishes its request headers (slowloris); this protocol closes it after `timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from qtts.request.errors import PayloadTooLarge, RequestTimeout, TTSError, openai_error_body


class BodyLimitMiddleware:
    """A pure ASGI middleware: request bodies of at most `max_bytes`, arriving without long stalls."""

    def __init__(self, app: Any, max_bytes: int, body_timeout_s: float = 30.0, body_deadline_s: float = 0.0):
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        self.body_deadline_s = body_deadline_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (
            self.max_bytes <= 0 and max(self.body_timeout_s, self.body_deadline_s) <= 0
        ):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k.lower() == b"content-length"), None)
        if 0 < self.max_bytes and length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _refuse(send, 413, self._too_large())
            return
        received = 0
        body_done = refused = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_deadline_s if self.body_deadline_s > 0 else None

        async def limited_receive() -> dict:
            nonlocal received, body_done, refused
            if body_done:
                return await receive()  # only http.disconnect from here on: no timeout
            wait = self.body_timeout_s or None
            left = None if deadline is None else deadline - loop.time()
            if left is not None and (wait is None or left < wait):
                wait = max(0.0, left)
            try:
                message = await asyncio.wait_for(receive(), wait)
            except TimeoutError:
                refused = True
                if left is not None and wait == max(0.0, left):
                    raise RequestTimeout(
                        f"the request body was not complete within {self.body_deadline_s:g} s; closing"
                    ) from None
                raise RequestTimeout(f"no request body data for {self.body_timeout_s:g} s; closing") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if 0 < self.max_bytes < received:
                    refused = True
                    raise self._too_large()
                body_done = not message.get("more_body", False)
            return message

        async def send_closing(message: dict) -> None:
            # The rest of a refused body is not read: the connection cannot carry another request.
            if refused and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, limited_receive, send_closing)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body is larger than the limit of {self.max_bytes} bytes")


async def _refuse(send: Any, status: int, exc: TTSError) -> None:
    body = json.dumps(openai_error_body(exc)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within
    `timeout_s` of it opening (or of the previous response ending)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            if timeout_s > 0:
                self._header_timer = self.loop.call_later(timeout_s, self._header_timeout)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            # IDLE: no complete request head since the timer was armed. A WebSocket upgrade
            # hands the transport to another protocol, which this must not close.
            if (
                self.transport.get_protocol() is self
                and not self.transport.is_closing()
                and self.conn.their_state is h11.IDLE
            ):
                self.transport.close()

    return HeaderTimeoutH11Protocol
