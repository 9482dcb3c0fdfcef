"""The gateway's end of `talker.v1.TalkerService/Session`: many Generate requests on one call.

A talker takes new calls one per turn of its event loop, so while it relays hundreds of streams a
burst of Generate calls waits hundreds of milliseconds to start (services/talker/session.py). A
`TalkerSession` keeps one Session call on a talker's channel and sends each new request as an
open on it, every open and cancel of a loop turn in one message.

`stream(request, metadata)` behaves as a Generate call: it yields the request's
GenerateResponses, and ends by returning (OK) or by raising the `grpc.aio.AioRpcError` that call
would have raised (code, details, trailing metadata with the retry hints), so the caller's error
handling is the same either way. Closing the iterator early sends a cancel. If the Session call
itself ends (the connection is lost, the talker drains, or it does not have Session: UNIMPLEMENTED),
every stream still on it fails with that status.

A session takes new opens for `rotate_s` from its start, then is half-closed (it ends once its
streams have) and the next open starts a new one: a session's life is then bounded as a Generate
call's is (its streams' length), so connection ageing (max_connection_age) and a talker's drain
cut no more streams than they cut calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import grpc

from qtts.pb import talker_pb2, talker_pb2_grpc

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
    """One Session call at a time on `channel`; see the module docstring."""

    def __init__(self, channel: grpc.aio.Channel, rotate_s: float = ROTATE_S, clock=time.monotonic):
        self._stub = talker_pb2_grpc.TalkerServiceStub(channel)
        self._rotate_s = rotate_s
        self._clock = clock
        self._current: _Call | None = None
        self._ids = itertools.count(1)
        self.unimplemented = False  # the talker has no Session: the caller uses Generate

    @property
    def idle(self) -> bool:
        """No Session call is open: none was made, or the last one ended."""
        return self._current is None or self._current.ended

    def _call(self) -> _Call:
        call = self._current
        if call is None or call.ended or call.closing or self._clock() - call.started >= self._rotate_s:
            if call is not None:
                call.half_close()
            call = self._current = _Call(self._stub, self._clock(), self)
        return call

    async def stream(
        self, request: talker_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncIterator[talker_pb2.GenerateResponse]:
        call = self._call()
        sid = next(self._ids)
        queue = call.open(sid, request, metadata)
        ended = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, talker_pb2.GenerateResponse):
                    yield item
                    continue
                ended = True
                if isinstance(item, _Failed):
                    if item.error.code() == grpc.StatusCode.UNIMPLEMENTED:
                        self.unimplemented = True
                    raise item.error
                if item.code == 0:
                    return
                raise _rpc_error(_code(item.code), item.message, _trailers(item))
        finally:
            call.forget(sid, cancel=not ended)

    async def close(self) -> None:
        if self._current is not None:
            await self._current.close()
            self._current = None


class _Call:
    """One Session call: its streams' queues, and the opens and cancels to send."""

    def __init__(self, stub: talker_pb2_grpc.TalkerServiceStub, started: float, owner: TalkerSession):
        self.started = started
        self.ended = False
        self.closing = False  # half-closed: no more opens
        self._streams: dict[int, asyncio.Queue] = {}
        self._opens: list[talker_pb2.SessionOpen] = []
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._owner = owner
        self._grpc_call = stub.Session(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    def open(self, sid: int, request: talker_pb2.GenerateRequest, metadata: tuple) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[sid] = queue
        self._opens.append(talker_pb2.SessionOpen(stream_id=sid, request=request, metadata=dict(metadata)))
        self._wake.set()
        return queue

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
            if self._opens or self._cancels:
                msg = talker_pb2.SessionRequest(open=self._opens, cancel=self._cancels)
                self._opens, self._cancels = [], []
                yield msg
            # Half-closed once no stream is left to cancel: the talker then ends the call.
            if self.closing and not self._streams:
                return

    async def _read(self) -> None:
        error = _rpc_error(grpc.StatusCode.UNAVAILABLE, "the talker ended the session")
        try:
            async for msg in self._grpc_call:
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
