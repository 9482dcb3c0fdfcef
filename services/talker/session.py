"""`talker.v1.TalkerService/Session`: many Generate requests on one call (see talker.proto).

grpc.aio takes a server's new calls one at a time, each after a turn of the event loop, so a
talker relaying hundreds of streams started a burst of Generate calls hundreds of milliseconds
late (a loop kept ~60% busy by 1 ms callbacks took 220 ms to start the last of 50 calls; the
H200's talker waited 53 ms on average, p95 up to 500 ms). A gateway's Session carries the
requests as messages instead: every open of a message starts in the turn that reads it.

Each open runs as a task of its own through the same path as a Generate call (`open_stream`),
counted, timed and logged under the Generate method as that call would be (tts_rpc_*, the access
log, the accept wait from the open's x-tts-sent-at-ns, the caller's calls seen), its request id
bound in its task. Its responses are queued with its stream id; the handler writes whatever is
queued as one SessionResponse per turn. A stream that fails ends with the status its Generate call
would have ended with (`map_exception`: code, message, retry hints); a cancel from the caller, or
the call's end, cancels the stream's task as cancelling its Generate call would.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from qtts.pb import talker_pb2
from qtts.serving import tracing
from qtts.serving.error_mapping import map_exception, record_call
from qtts.serving.log_context import bind_request_id, request_id_from_metadata, waited_since_sent
from qtts.serving.session_calls import ServerSession

from .room import SeenCalls

log = logging.getLogger(__name__)

GENERATE = "/talker.v1.TalkerService/Generate"
GENERATE_STREAM = "/talker.v1.TalkerService/GenerateStream"  # a stream whose text follows
SESSION = "/talker.v1.TalkerService/Session"
# Responses in one SessionResponse at most (an audio chunk is up to ~60 kB): one message per turn
# unless more are queued.
MAX_EVENTS_PER_MESSAGE = 64


class _Session(ServerSession):
    """One Session call's streams, the text queues of those whose text follows, and their output."""

    def __init__(self) -> None:
        super().__init__(
            talker_pb2.SessionResponse, talker_pb2.SessionEvent, talker_pb2.SessionEnd, MAX_EVENTS_PER_MESSAGE
        )
        self.texts: dict[int, asyncio.Queue] = {}  # (piece, final) of the streams whose text follows


class SessionServer:
    """Serves Session calls; `open_stream(request, text)` yields a request's GenerateResponses
    (the servicer's Generate path; `text`: the (piece, final) pairs appended, or None)."""

    def __init__(
        self,
        open_stream: Callable[
            [talker_pb2.GenerateRequest, AsyncIterator[tuple[str, bool]] | None], AsyncIterator[Any]
        ],
        seen: SeenCalls,
        stopping: asyncio.Event,
    ):
        self._open_stream = open_stream
        self._seen = seen
        self._stopping = stopping
        self._live: set[_Session] = set()
        self.metrics: Any = None  # the talker's ServiceMetrics, once the server has them
        self.on_unexpected: Callable[[BaseException], Any] | None = None

    def wake_all(self) -> None:
        """The talker drains: each Session ends once its streams have (new opens are refused)."""
        for session in self._live:
            session.wake.set()

    async def serve(self, requests: AsyncIterator[talker_pb2.SessionRequest]) -> AsyncIterator[Any]:
        session = _Session()
        if self.metrics is not None:
            session.on_written = functools.partial(self.metrics.session_written, SESSION)
        self._live.add(session)
        reader = asyncio.ensure_future(self._read(requests, session))
        try:
            responses = session.responses(reader, lambda: session.half_closed or self._stopping.is_set())
            async with contextlib.aclosing(responses) as msgs:
                async for msg in msgs:
                    yield msg
        finally:
            self._live.discard(session)

    async def _read(self, requests: AsyncIterator[talker_pb2.SessionRequest], session: _Session) -> None:
        try:
            async for msg in requests:
                for op in msg.open:
                    self._open(op, session)
                for more in msg.append:
                    queue = session.texts.get(more.stream_id)
                    if queue is not None:
                        queue.put_nowait((more.text, more.final))
                for stream_id in msg.cancel:
                    task = session.tasks.get(stream_id)
                    if task is not None:
                        task.cancel()
        finally:
            session.half_closed = True
            for queue in session.texts.values():  # no more appends: their text is complete
                queue.put_nowait(("", True))
            session.wake.set()

    def _open(self, op: talker_pb2.SessionOpen, session: _Session) -> None:
        metadata = tuple(op.metadata.items())
        if op.stream_id in session.tasks:
            session.end(
                op.stream_id,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream_id {op.stream_id} is already open on this session",
            )
            return
        self._seen.saw(metadata)
        if self._stopping.is_set():
            method = GENERATE_STREAM if op.text_follows else GENERATE
            self._refuse(op.stream_id, method, session, "the talker is draining: retry on another talker")
            return
        text = None
        if op.text_follows:
            queue = session.texts[op.stream_id] = asyncio.Queue()
            text = _appended(queue)
        session.tasks[op.stream_id] = asyncio.ensure_future(self._run(op, metadata, session, text))

    def _refuse(self, stream_id: int, method: str, session: _Session, message: str) -> None:
        if self.metrics is not None:
            self.metrics.error(grpc.StatusCode.UNAVAILABLE.name)
        record_call(self.metrics, method, grpc.StatusCode.UNAVAILABLE, time.monotonic())
        session.end(stream_id, grpc.StatusCode.UNAVAILABLE, message)

    async def _run(
        self,
        op: talker_pb2.SessionOpen,
        metadata: tuple,
        session: _Session,
        text: AsyncIterator[tuple[str, bool]] | None,
    ) -> None:
        start, code = time.monotonic(), None
        method = GENERATE_STREAM if op.text_follows else GENERATE  # counted as its call would be
        bind_request_id(request_id_from_metadata(metadata))  # this task's own context
        waited = waited_since_sent(metadata)
        if self.metrics is not None and waited is not None:
            self.metrics.rpc_accepted(method, waited)
        sid = op.stream_id
        try:
            with self._span(method, metadata):
                async with contextlib.aclosing(self._open_stream(op.request, text)) as msgs:
                    async for msg in msgs:
                        session.emit(sid, msg)
            code = grpc.StatusCode.OK
            session.end(sid, code)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the caller cancelled it or left: no end to send
            raise
        except Exception as exc:  # noqa: BLE001 - the stream ends with its mapped status
            status = map_exception(exc, method, on_unexpected=self.on_unexpected)
            code = status.code
            if self.metrics is not None:
                self.metrics.error(code.name)
            session.end(sid, code, status.message, status.trailing)
        finally:
            session.tasks.pop(sid, None)
            session.texts.pop(sid, None)
            session.wake.set()
            record_call(self.metrics, method, code, start)

    @staticmethod
    def _span(method: str, metadata: tuple):
        if not tracing.enabled():
            return contextlib.nullcontext()
        carrier = {k: v for k, v in metadata if isinstance(v, str)}
        attrs = {"rpc.system": "grpc", "rpc.method": method, "qtts.service": "talker", "qtts.session": True}
        return tracing.server_span(method.lstrip("/"), carrier, attrs)


async def _appended(queue: asyncio.Queue) -> AsyncIterator[tuple[str, bool]]:
    """A text-following stream's appends, until the final one."""
    while True:
        piece, final = await queue.get()
        yield piece, final
        if final:
            return
