"""The gateway's end of `talker.v1.TalkerService/Session`: many Generate requests on one call.

A talker takes new calls one per turn of its event loop, so while it relays hundreds of streams a
burst of Generate calls waits hundreds of milliseconds to start (services/talker/session.py). A
`TalkerSession` keeps a Session call on a talker's channel and sends each new request as an open
on it, every open, append and cancel of a loop turn in one message.

`open(request, metadata, text)` behaves as a Generate call (with `text`, a GenerateStream call:
an open with `text_follows`, then its pieces as appends): it yields the request's
GenerateResponses, and ends by returning (OK) or by raising the `grpc.aio.AioRpcError` that call
would have raised (code, details, trailing metadata with the retry hints), so the caller's error
handling is the same either way. Closing the iterator early sends a cancel. If the Session call
itself ends (the connection is lost, the talker drains), every stream still on it fails with that
status. Which call a stream goes on, and when none has answered yet (the caller then makes a call
of its own), is `qtts.serving.session_calls`: calls are rotated every `rotate_s`, and a talker
that answers UNIMPLEMENTED (one from before Session) is not asked again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

import grpc

from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.session_calls import ClientCall, Failed, Received, SessionCalls, end_error

ROTATE_S = 30.0
SESSION = "/talker.v1.TalkerService/Session"


class TalkerSession:
    """The Session calls on `channel` (qtts.serving.session_calls); see the module docstring."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        rotate_s: float = ROTATE_S,
        clock=time.monotonic,
        on_written: Callable[[float], None] | None = None,
    ):
        """`on_written(seconds)`: each message's write time (ClientCall)."""
        stub = talker_pb2_grpc.TalkerServiceStub(channel)
        self._calls: SessionCalls[_Call] = SessionCalls(
            lambda now: _Call(stub, now, on_written), rotate_s, clock
        )
        self._ids = itertools.count(1)

    @property
    def unimplemented(self) -> bool:
        """The talker has no Session: the caller makes Generate calls."""
        return self._calls.unimplemented

    @property
    def idle(self) -> bool:
        """No Session call is open or opening."""
        return self._calls.idle

    def open(
        self,
        request: talker_pb2.GenerateRequest,
        metadata: tuple[tuple[str, str], ...],
        text: AsyncIterator[tuple[str, bool]] | None = None,
    ) -> AsyncIterator[talker_pb2.GenerateResponse] | None:
        """The request as a stream on the session call in use (with `text`: the (piece, final)
        pairs to append, as GenerateStream's), or None while no call has answered yet (one is
        opened meanwhile): the caller makes a call of its own."""
        call = self._calls.current()
        if call is None:
            return None
        return self._stream(call, next(self._ids), request, metadata, text)

    async def _stream(
        self,
        call: _Call,
        sid: int,
        request: talker_pb2.GenerateRequest,
        metadata: tuple[tuple[str, str], ...],
        text: AsyncIterator[tuple[str, bool]] | None,
    ) -> AsyncIterator[talker_pb2.GenerateResponse]:
        queue = call.open(sid, request, metadata, text_follows=text is not None)
        pump = asyncio.ensure_future(call.pump_text(sid, text)) if text is not None else None
        ended = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Received):
                    yield item.response
                    continue
                ended = True
                if isinstance(item, Failed):
                    raise item.error
                if item.code == 0:
                    return
                raise end_error(item)
        finally:
            if pump is not None:
                pump.cancel()
            call.forget(sid, cancel=not ended)

    async def close(self) -> None:
        await self._calls.close()


class _Call(ClientCall):
    """One Session call: its streams, and the opens, appends and cancels to send."""

    gone = "the gateway closed the session"

    def __init__(
        self,
        stub: talker_pb2_grpc.TalkerServiceStub,
        started: float,
        on_written: Callable[[float], None] | None = None,
    ):
        self._opens: list[talker_pb2.SessionOpen] = []
        self._appends: list[talker_pb2.SessionAppend] = []
        super().__init__(stub.Session, started, on_written)

    def open(
        self, sid: int, request: talker_pb2.GenerateRequest, metadata: tuple, text_follows: bool = False
    ) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[sid] = queue
        self._opens.append(
            talker_pb2.SessionOpen(
                stream_id=sid, request=request, metadata=dict(metadata), text_follows=text_follows
            )
        )
        self.wake()
        return queue

    async def pump_text(self, sid: int, text: AsyncIterator[tuple[str, bool]]) -> None:
        """Send `text`'s pieces as appends until the final one (an end without one sends it)."""
        final = False
        async for piece, final in text:
            if sid not in self.streams:
                return
            self._appends.append(talker_pb2.SessionAppend(stream_id=sid, text=piece, final=final))
            self.wake()
            if final:
                return
        if not final and sid in self.streams:
            self._appends.append(talker_pb2.SessionAppend(stream_id=sid, final=True))
            self.wake()

    def _take(self) -> talker_pb2.SessionRequest | None:
        if not (self._opens or self._appends or self._cancels):
            return None
        msg = talker_pb2.SessionRequest(open=self._opens, append=self._appends, cancel=self.take_cancels())
        self._opens, self._appends = [], []
        return msg
