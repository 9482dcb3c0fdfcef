"""Session calls: many streams on one long-lived call, as the gateway's Session per talker and
the talker's DecodeSession per code2wav replica carry them. Here: which call new streams go on
(`SessionCalls`), the caller's side of one call (`ClientCall`), and a stream's status as its own
call would have had it (`end_message`, `end_error`).

A session call is used only once it has answered (its server sends an empty message at once), so
a stream never goes on a call whose server turns out not to have the method, or is unreachable:
until then the caller makes a call of its own for the stream. A call takes new streams for
`rotate_s`; then the next one is opened, and the old one takes new streams until the new one has
answered, then is half-closed (it ends with its last stream). So a call lives about as long as
the streams put on it in `rotate_s`, and a drain or connection ageing cuts no more than it would
cut calls of their own. A server that answers UNIMPLEMENTED is not asked again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import grpc


class SessionCall(Protocol):
    started: float
    answered: bool  # its first message came
    ended: bool
    unimplemented: bool  # it ended UNIMPLEMENTED before answering

    def half_close(self) -> None: ...

    async def close(self) -> None: ...


C = TypeVar("C", bound=SessionCall)


class SessionCalls(Generic[C]):
    """The call in use (answered) and the one opening; `current()` for a new stream."""

    def __init__(
        self, open_call: Callable[[float], C], rotate_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self._open = open_call
        self._rotate_s = rotate_s
        self._clock = clock
        self._in_use: C | None = None
        self._opening: C | None = None
        self._unimplemented = False

    @property
    def unimplemented(self) -> bool:
        """The server has no such method (its answer to the first call): it is not asked again."""
        self._settle()
        return self._unimplemented

    def _settle(self) -> None:
        """Put an answered opening call in use (half-closing the old one); drop ended calls."""
        opening = self._opening
        if opening is not None:
            if opening.answered and not opening.ended:
                if self._in_use is not None:
                    self._in_use.half_close()
                self._in_use, self._opening = opening, None
            elif opening.ended:
                self._opening = None
                self._unimplemented = self._unimplemented or opening.unimplemented
        if self._in_use is not None and self._in_use.ended:
            self._in_use = None

    def current(self) -> C | None:
        """The call a new stream goes on now, or None (the caller makes a call of its own; a
        session call is opened meanwhile, unless the server has none)."""
        self._settle()
        if self._unimplemented:
            return None
        now = self._clock()
        if self._opening is None and (self._in_use is None or now - self._in_use.started >= self._rotate_s):
            self._opening = self._open(now)
        return self._in_use

    @property
    def idle(self) -> bool:
        """No call is in use or opening."""
        return (self._in_use is None or self._in_use.ended) and (self._opening is None or self._opening.ended)

    async def close(self) -> None:
        for call in (self._in_use, self._opening):
            if call is not None:
                await call.close()
        self._in_use = self._opening = None


# ---------------------------------------------------------------- a stream's status on a session


def end_message(
    cls: type, stream_id: int, code: grpc.StatusCode, message: str = "", trailing: tuple = ()
) -> Any:
    """A server's end of one stream (`cls`: its SessionEnd type): the code, message and trailing
    metadata the stream's own call would have ended with."""
    trailers = {k: v.encode() if isinstance(v, str) else bytes(v) for k, v in trailing}
    return cls(stream_id=stream_id, code=code.value[0], message=message, trailers=trailers)


def rpc_error(
    code: grpc.StatusCode, details: str, trailers: Mapping[str, bytes] | None = None
) -> grpc.aio.AioRpcError:
    """The error the stream's own call would have raised (binary -bin trailers stay bytes)."""
    metadata = grpc.aio.Metadata(
        *((k, v if k.endswith("-bin") else v.decode()) for k, v in (trailers or {}).items())
    )
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), metadata, details)


def end_error(end: Any) -> grpc.aio.AioRpcError:
    """The error of a SessionEnd whose code is not OK."""
    code = next((c for c in grpc.StatusCode if c.value[0] == end.code), grpc.StatusCode.UNKNOWN)
    return rpc_error(code, end.message, dict(end.trailers))


class ServerSession:
    """The server's side of one session call: its streams' tasks, and the events and ends queued
    to write (`emit`, `end`). `responses(reader, finished)` is what the handler yields: an empty
    message at once (the caller may put streams on the call from then on), then whatever is
    queued as one message per turn (at most `max_events` events; a stream's end after its
    events), until no stream runs and `finished()` says no more will come; it cancels the
    `reader` task and every stream's task when it ends. `on_written(seconds)`, when set, gets
    each message's time from its oldest event or end being queued to the message written (what a
    stream's hop counts as zero: on a session, handing on is queueing)."""

    def __init__(self, response_cls: type, event_cls: type, end_cls: type, max_events: int):
        self._response_cls, self._event_cls, self._end_cls = response_cls, event_cls, end_cls
        self._max_events = max_events
        self.on_written: Callable[[float], None] | None = None
        self._queued_at = 0.0  # when the oldest unsent event or end was queued (0: none)
        self.tasks: dict[int, asyncio.Task] = {}
        self.events: list[Any] = []
        self.ends: list[Any] = []
        self.wake = asyncio.Event()
        self.half_closed = False  # the caller sends nothing more

    def emit(self, stream_id: int, response: Any) -> None:
        self.events.append(self._event_cls(stream_id=stream_id, response=response))
        self._queued()

    def end(self, stream_id: int, code: grpc.StatusCode, message: str = "", trailing: tuple = ()) -> None:
        self.ends.append(end_message(self._end_cls, stream_id, code, message, trailing))
        self._queued()

    def _queued(self) -> None:
        if not self._queued_at:
            self._queued_at = time.perf_counter()
        self.wake.set()

    def _written(self, queued_at: float) -> None:
        """The message with what was queued from `queued_at` on was written."""
        if self.on_written is not None:
            self.on_written(time.perf_counter() - queued_at)

    async def responses(self, reader: asyncio.Task, finished: Callable[[], bool]) -> AsyncIterator[Any]:
        try:
            yield self._response_cls()
            while True:
                if self.events or self.ends:
                    # After a yield the message is written: gRPC asks for the next one then.
                    queued_at = self._queued_at
                    events = self.events[: self._max_events]
                    del self.events[: len(events)]
                    if self.events:  # ends wait for the events before them
                        self._queued_at = time.perf_counter()  # the rest: from now, a lower bound
                        yield self._response_cls(events=events)
                        self._written(queued_at)
                        continue
                    ends, self.ends = self.ends, []
                    self._queued_at = 0.0
                    yield self._response_cls(events=events, ends=ends)
                    self._written(queued_at)
                    continue
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    raise reader.exception()
                if not self.tasks and finished():
                    return
                self.wake.clear()
                await self.wake.wait()
        finally:
            reader.cancel()
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(reader, *self.tasks.values(), return_exceptions=True)


class Received(NamedTuple):
    """A stream's response as a `ClientCall` queues it: `at` is when its message was read off the
    call (time.perf_counter), so the stream can tell its wait on this side's event loop."""

    response: Any
    at: float


class Failed:
    """Queued to every stream of a session call that ended: the status they fail with."""

    def __init__(self, error: grpc.aio.AioRpcError):
        self.error = error


class ClientCall:
    """The caller's side of one session call: each stream's queue of responses (`Received`) and ends, and what
    is to be sent. A subclass says what its request message is (`_take`); the rest is shared.
    `on_written(seconds)`, when given, gets each message's time from the first of what it carries
    being queued to the message written."""

    gone = "the caller closed the session"

    def __init__(
        self,
        start_call: Callable[[AsyncIterator[Any]], Any],
        started: float,
        on_written: Callable[[float], None] | None = None,
    ):
        self.started = started
        self._on_written = on_written
        self._queued_at = 0.0  # when the first unsent item was queued (0: none)
        self.answered = False  # the server's first (empty) message came
        self.ended = False
        self.unimplemented = False  # it ended UNIMPLEMENTED before answering
        self.closing = False  # no new streams: half-closed once none is left
        self.streams: dict[int, asyncio.Queue] = {}
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self._grpc_call = start_call(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    def _take(self) -> Any:
        """The message of what is pending (and clear it), or None."""
        raise NotImplementedError

    def wake(self) -> None:
        """Something was queued to send."""
        if not self._queued_at:
            self._queued_at = time.perf_counter()
        self._wake.set()

    def forget(self, sid: int, cancel: bool) -> None:
        """The stream is done with (`cancel`: cancel it on the server, as cancelling its call)."""
        if self.streams.pop(sid, None) is not None and cancel and not self.ended:
            self._cancels.append(sid)
        self._wake.set()  # a cancel to send, or a half-close once no stream is left

    def take_cancels(self) -> list[int]:
        cancels, self._cancels = self._cancels, []
        return cancels

    def half_close(self) -> None:
        self.closing = True
        self._wake.set()

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            queued_at, self._queued_at = self._queued_at, 0.0
            msg = self._take()
            if msg is not None:
                yield msg  # resumed once gRPC has written it
                if self._on_written is not None and queued_at:
                    self._on_written(time.perf_counter() - queued_at)
            # Half-closed once no stream is left to cancel: the server then ends the call.
            if self.closing and not self.streams:
                return

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the server ended the session")
        try:
            async for msg in self._grpc_call:
                self.answered = True
                at = time.perf_counter()
                for event in msg.events:
                    queue = self.streams.get(event.stream_id)
                    if queue is not None:
                        queue.put_nowait(Received(event.response, at))
                for end in msg.ends:
                    queue = self.streams.get(end.stream_id)
                    if queue is not None:
                        queue.put_nowait(end)
        except grpc.aio.AioRpcError as exc:
            error = exc
            self.unimplemented = exc.code() == grpc.StatusCode.UNIMPLEMENTED and not self.answered
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, self.gone)
            raise
        finally:
            self.ended = True
            for queue in self.streams.values():
                queue.put_nowait(Failed(error))

    async def close(self) -> None:
        self._grpc_call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
