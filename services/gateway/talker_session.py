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
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import grpc

from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.session_calls import SessionCalls

ROTATE_S = 30.0


def _rpc_error(
    code: grpc.StatusCode, details: str, trailing: grpc.aio.Metadata | None = None
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)


def _code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def _trailers(end: talker_pb2.SessionEnd) -> grpc.aio.Metadata:
    """The end's trailing metadata as the Generate call's would be: binary keys (-bin) as bytes."""
    return grpc.aio.Metadata(*((k, v if k.endswith("-bin") else v.decode()) for k, v in end.trailers.items()))


class _Failed:
    """Queued to every stream when the Session call ends: the status they fail with."""

    def __init__(self, error: grpc.aio.AioRpcError):
        self.error = error


class TalkerSession:
    """The Session calls on `channel` (qtts.serving.session_calls); see the module docstring."""

    def __init__(self, channel: grpc.aio.Channel, rotate_s: float = ROTATE_S, clock=time.monotonic):
        stub = talker_pb2_grpc.TalkerServiceStub(channel)
        self._calls: SessionCalls[_Call] = SessionCalls(lambda now: _Call(stub, now), rotate_s, clock)
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
                if isinstance(item, talker_pb2.GenerateResponse):
                    yield item
                    continue
                ended = True
                if isinstance(item, _Failed):
                    raise item.error
                if item.code == 0:
                    return
                raise _rpc_error(_code(item.code), item.message, _trailers(item))
        finally:
            if pump is not None:
                pump.cancel()
            call.forget(sid, cancel=not ended)

    async def close(self) -> None:
        await self._calls.close()


class _Call:
    """One Session call: its streams' queues, and the opens and cancels to send."""

    def __init__(self, stub: talker_pb2_grpc.TalkerServiceStub, started: float):
        self.started = started
        self.answered = False  # the talker's first (empty) message came
        self.ended = False
        self.unimplemented = False
        self.closing = False  # half-closed: no more opens
        self._streams: dict[int, asyncio.Queue] = {}
        self._opens: list[talker_pb2.SessionOpen] = []
        self._appends: list[talker_pb2.SessionAppend] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._grpc_call = stub.Session(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    def open(
        self, sid: int, request: talker_pb2.GenerateRequest, metadata: tuple, text_follows: bool = False
    ) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[sid] = queue
        self._opens.append(
            talker_pb2.SessionOpen(
                stream_id=sid, request=request, metadata=dict(metadata), text_follows=text_follows
            )
        )
        self._wake.set()
        return queue

    async def pump_text(self, sid: int, text: AsyncIterator[tuple[str, bool]]) -> None:
        """Send `text`'s pieces as appends until the final one (an end without one sends it)."""
        final = False
        async for piece, final in text:
            if sid not in self._streams:
                return
            self._appends.append(talker_pb2.SessionAppend(stream_id=sid, text=piece, final=final))
            self._wake.set()
            if final:
                return
        if not final and sid in self._streams:
            self._appends.append(talker_pb2.SessionAppend(stream_id=sid, final=True))
            self._wake.set()

    def forget(self, sid: int, cancel: bool) -> None:
        if self._streams.pop(sid, None) is not None and cancel and not self.ended:
            self._cancels.append(sid)
            self._wake.set()
        if self.closing and not self._streams:
            self._wake.set()  # the request stream may end now

    def half_close(self) -> None:
        self.closing = True
        self._wake.set()

    async def _requests(self) -> AsyncIterator[talker_pb2.SessionRequest]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._opens or self._appends or self._cancels:
                msg = talker_pb2.SessionRequest(open=self._opens, append=self._appends, cancel=self._cancels)
                self._opens, self._appends, self._cancels = [], [], []
                yield msg
            # Half-closed once no stream is left to cancel: the talker then ends the call.
            if self.closing and not self._streams:
                return

    async def _read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the talker ended the session")
        try:
            async for msg in self._grpc_call:
                self.answered = True
                for event in msg.events:
                    queue = self._streams.get(event.stream_id)
                    if queue is not None:
                        queue.put_nowait(event.response)
                for end in msg.ends:
                    queue = self._streams.get(end.stream_id)
                    if queue is not None:
                        queue.put_nowait(end)
        except grpc.aio.AioRpcError as exc:
            error = exc
            self.unimplemented = exc.code() == grpc.StatusCode.UNIMPLEMENTED and not self.answered
        except asyncio.CancelledError:
            error = _rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the session")
            raise
        finally:
            self.ended = True
            for queue in self._streams.values():
                queue.put_nowait(_Failed(error))

    async def close(self) -> None:
        self._grpc_call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
