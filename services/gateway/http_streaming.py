"""An ASGI streaming response that notices a client disconnect even while no byte is being sent.

Starlette's StreamingResponse only learns that the client left on its next write (ASGI >= 2.4),
which can be long after the client went away; a TTS stream must free its talker slot and decoder
state at once. This response watches `receive()` for `http.disconnect` next to the body pump,
cancels the pump when it comes, and always closes the body iterator and runs `on_close`.

Two more ways a stream ends early, both aborting the connection so the client sees an incomplete
body (no terminating chunk), never a clean end of a shorter file:
- an error after the first byte (the stream failed mid-way);
- a client that takes no bytes for `write_timeout_s` (a listener that never reads would otherwise
  hold its talker slot for as long as it likes).
The abort is a `StreamAborted` raised to the server, whose traceback `AbortedStreamLogFilter`
keeps out of the log: the stream's own one-line reason has been logged already.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from qtts.request.errors import Cancelled, mapping_for

T = TypeVar("T")
log = logging.getLogger(__name__)


class StreamAborted(BaseException):
    """Raised to the ASGI server to drop a connection whose response has already started (a
    BaseException: Starlette would turn an Exception into a RuntimeError and a traceback)."""


class AbortedStreamLogFilter(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" record for a `StreamAborted`."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, StreamAborted):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


def install_abort_log_filter(logger_name: str = "uvicorn.error") -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, AbortedStreamLogFilter) for f in logger.filters):
        logger.addFilter(AbortedStreamLogFilter())


class DisconnectAwareStreamingResponse(Response):
    """Streams `chunks`; cancels them when the client disconnects."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        *,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        media_type: str | None = None,
        write_timeout_s: float = 0.0,
        request_id: str = "",
    ):
        self._chunks = chunks
        self._write_timeout_s = write_timeout_s
        self._request_id = request_id
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._chunks:
            await self._send_body(send, chunk)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_body(self, send: Send, chunk: bytes) -> None:
        # The server's send blocks while the client's TCP window is full (flow control).
        message = {"type": "http.response.body", "body": chunk, "more_body": True}
        if self._write_timeout_s <= 0:
            await send(message)
            return
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands while
        # its inner send has just finished, and once the client has gone every send finishes at
        # once, so the pump cancelled on the disconnect streamed on into nothing until the talker
        # ended it (the slot held for the stream's whole length).
        try:
            async with asyncio.timeout(self._write_timeout_s):
                await send(message)
        except TimeoutError:
            raise Cancelled(f"the client took no audio for {self._write_timeout_s:g} s") from None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and (exc := pump.exception()) is not None:
                # The response has started: only dropping the connection tells the client.
                m = mapping_for(exc)
                log.warning(
                    "stream %s aborted: %s: %s",
                    self._request_id,
                    m.grpc_code.name,
                    getattr(exc, "message", None) or type(exc).__name__,
                )
                raise StreamAborted(self._request_id) from exc
        finally:
            for task in (pump, watch):
                task.cancel()
            for task in (pump, watch):
                # A pump error has been reported above (or the client went away): not again here.
                await _ended(task)
            await self._chunks.aclose()


async def _ended(task: asyncio.Task, every_s: float = 0.5) -> None:
    """Wait for the cancelled `task` to end, cancelling it again every `every_s` while it runs on (a
    cancel that some library swallowed must not keep a stream, and its talker slot, for good); its
    outcome is retrieved, not raised."""
    while not task.done():
        await asyncio.wait({task}, timeout=every_s)
        if not task.done():
            task.cancel()
    if not task.cancelled():
        task.exception()


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`; raise `Cancelled` (and cancel it) if the client disconnects first."""
    task = asyncio.ensure_future(work())
    watch = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise Cancelled("client disconnected")
    finally:
        for t in (task, watch):
            t.cancel()
        for t in (task, watch):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
