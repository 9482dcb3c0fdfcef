"""An ASGI streaming response that notices a client disconnect even while no byte is being sent.

Starlette's StreamingResponse only learns that the client left on its next write (ASGI >= 2.4),
which can be long after the client went away; a TTS stream must free its talker slot and decoder
state at once. This response watches `receive()` for `http.disconnect` next to the body pump,
cancels the pump when it comes, and always closes the body iterator and runs `on_close`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from qtts.errors import Cancelled

T = TypeVar("T")


class DisconnectAwareStreamingResponse(Response):
    """Streams `chunks`; cancels them when the client disconnects."""

    def __init__(self, chunks: AsyncIterator[bytes], *, status_code: int = 200,
                 headers: dict[str, str] | None = None, media_type: str | None = None):
        self._chunks = chunks
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()  # an error after the first byte aborts the connection
        finally:
            for task in (pump, watch):
                task.cancel()
            for task in (pump, watch):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            await self._chunks.aclose()


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
