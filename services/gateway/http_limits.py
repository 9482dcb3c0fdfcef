"""Limits on what one HTTP client can hold of the gateway: the body size, how slowly a request may
arrive, and how long a response may wait for a client that reads nothing.

- `BodyLimitMiddleware`: a `Content-Length` above the limit is a 413 before any of the body is
  read; a chunked body is counted as it arrives and refused once it passes the limit, so no body
  larger than the limit is ever held in memory. A body that stalls for `body_timeout_s` between
  two pieces is a 408, and so is one not complete `body_deadline_s` after its request began (one
  byte every 20 s never stalls, and held a request open for good).
- `header_timeout_protocol`: uvicorn closes idle keep-alive connections, but not a connection that
  never finishes its request headers (slowloris); this protocol closes it after `timeout_s`.
  It also closes as nginx's lingering close does: a response sent before the request body was
  all read (a 413, a 408) is followed by a half-close, and the rest of the body is read and
  discarded, up to `Linger`'s bounds, before the socket closes. Closing at once with unread data
  sends a reset, and a client that writes its whole body before reading (Python's http.client,
  requests, httpx: no `Expect: 100-continue`) saw that reset instead of the 413.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
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
            try:  # asyncio.timeout: wait_for can swallow a cancel (http_streaming.py)
                async with asyncio.timeout(wait):
                    message = await receive()
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


@dataclass(frozen=True)
class Linger:
    """Bounds on reading the rest of a refused request body (nginx: lingering_time 30 s,
    lingering_timeout 5 s). Past any of them the socket closes, unread data or not."""

    max_bytes: int = 256 << 20
    max_s: float = 30.0
    idle_s: float = 5.0


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` asks the protocol, which lingers
    while the client is still sending its request body; everything else is the real transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: Any):
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_or_linger()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def header_timeout_protocol(timeout_s: float, linger: Linger | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within
    `timeout_s` of it opening (or of the previous response ending), and lingering (`Linger`) when
    it closes before the request body was all read."""
    linger = linger or Linger()

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _linger_ends = 0.0
        _lingered = 0
        _lost = False
        lingering = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._raw = transport
            super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._lost = True
            self._disarm_header_timer()
            self._end_linger_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def shutdown(self) -> None:
            # The server stops: a lingering connection closes now.
            if self.lingering:
                self._raw.close()
            else:
                super().shutdown()

        def data_received(self, data: bytes) -> None:
            if not self.lingering:
                super().data_received(data)
                return
            self._lingered += len(data)
            if self._lingered > linger.max_bytes:
                self._raw.close()
            else:
                self._arm_linger_timer()

        def eof_received(self) -> bool | None:
            if self.lingering:
                self._raw.close()  # the client sent all it had: the answer is in its buffer
            return super().eof_received()

        def close_or_linger(self) -> None:
            """Close, unless the client is still sending a request body: then half-close (the
            response stays readable) and discard what comes until it ends or a bound is hit."""
            raw = self._raw
            if self.lingering or raw.is_closing():
                return
            if self._lost or raw.get_protocol() is not self or self.conn.their_state is not h11.SEND_BODY:
                raw.close()
                return
            self.lingering = True
            self._disarm_header_timer()
            self._unset_keepalive_if_required()
            if raw.can_write_eof():
                raw.write_eof()
            raw.resume_reading()
            self._linger_ends = self.loop.time() + linger.max_s
            self._arm_linger_timer()

        def _arm_linger_timer(self) -> None:
            self._end_linger_timer()
            wait = min(linger.idle_s, self._linger_ends - self.loop.time())
            self._linger_timer = self.loop.call_later(max(0.0, wait), self._raw.close)

        def _end_linger_timer(self) -> None:
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            if timeout_s > 0 and not self.lingering:
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
                self._raw.get_protocol() is self
                and not self._raw.is_closing()
                and self.conn.their_state is h11.IDLE
            ):
                self._raw.close()

    return HeaderTimeoutH11Protocol
