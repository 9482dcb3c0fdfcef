"""`code2wav.v1.Code2WavService/DecodeSession`: many Decode streams on one call (see the proto).

A talker's stream used a Decode call of its own: a call to open (grpc.aio takes new calls one per
loop turn), and a write per message per stream on both sides. A DecodeSession carries every
stream's messages of a turn in one message. Each stream runs the servicer's Decode path
(`decode(requests, cancelled)`) in a task of its own, fed from a queue; its responses are tagged
with the caller's stream id, and it ends with the status its Decode call would have ended with.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from qtts.pb import code2wav_pb2 as pb
from qtts.request.errors import FailedPrecondition
from qtts.serving.error_mapping import map_exception, record_call
from qtts.serving.log_context import bind_request_id
from qtts.serving.session_calls import Received, ServerSession

DECODE = "/code2wav.v1.Code2WavService/Decode"
DECODE_SESSION = "/code2wav.v1.Code2WavService/DecodeSession"
MAX_EVENTS_PER_MESSAGE = 128
ENDED_KEPT = 4096  # ended stream ids remembered per session
_DONE_WRITING = None


class _Session(ServerSession):
    def __init__(self) -> None:
        super().__init__(
            pb.DecodeSessionResponse, pb.DecodeSessionEvent, pb.DecodeSessionEnd, MAX_EVENTS_PER_MESSAGE
        )
        self.inputs: dict[int, asyncio.Queue] = {}
        self.cancelled: set[int] = set()
        # Streams that ended here: a message the talker sent before it saw the end (frames in
        # flight when a stream failed) is dropped, not taken as the start of a new stream.
        self.ended: collections.OrderedDict[int, None] = collections.OrderedDict()


class DecodeSessionServer:
    """Serves DecodeSession calls over `decode(requests, cancelled)` (the servicer's Decode path)."""

    def __init__(self, decode: Callable[..., AsyncIterator[pb.DecodeResponse]], metrics: Any = None):
        self._decode = decode
        self.metrics = metrics

    async def serve(self, requests: AsyncIterator[pb.DecodeSessionRequest]) -> AsyncIterator[Any]:
        session = _Session()
        if self.metrics is not None:
            session.on_written = functools.partial(self.metrics.session_written, DECODE_SESSION)
        reader = asyncio.ensure_future(self._read(requests, session))
        async with contextlib.aclosing(session.responses(reader, lambda: session.half_closed)) as msgs:
            async for msg in msgs:
                yield msg

    async def _read(self, requests: AsyncIterator[pb.DecodeSessionRequest], session: _Session) -> None:
        try:
            async for msg in requests:
                at = time.perf_counter()
                for item in msg.messages:
                    queue = session.inputs.get(item.stream_id)
                    if queue is None:
                        if item.stream_id in session.tasks or item.stream_id in session.ended:
                            continue  # its requests were complete, or it ended: nothing more is read
                        queue = session.inputs[item.stream_id] = asyncio.Queue()
                        session.tasks[item.stream_id] = asyncio.ensure_future(
                            self._run(item.stream_id, queue, session)
                        )
                    queue.put_nowait(Received(item.request, at))
                for sid in msg.done_writing:
                    queue = session.inputs.pop(sid, None)
                    if queue is not None:
                        queue.put_nowait(_DONE_WRITING)
                for sid in msg.cancel:
                    session.cancelled.add(sid)
                    task = session.tasks.get(sid)
                    if task is not None:
                        task.cancel()
        finally:
            session.half_closed = True
            for queue in session.inputs.values():  # as the end of each call's requests
                queue.put_nowait(_DONE_WRITING)
            session.inputs.clear()
            session.wake.set()

    async def _run(self, sid: int, queue: asyncio.Queue, session: _Session) -> None:
        start, code = time.monotonic(), None
        try:
            first = await queue.get()
            if first is not _DONE_WRITING and first.response.WhichOneof("event") == "start":
                bind_request_id(first.response.start.request_id)  # for this stream's log lines
            waited = None if self.metrics is None else self.metrics.session_message_wait_seconds.observe
            requests = _prepend(first, queue, waited)
            responses = self._decode(requests, lambda: sid in session.cancelled)
            async with contextlib.aclosing(responses) as msgs:
                async for msg in msgs:
                    session.emit(sid, msg)
            code = grpc.StatusCode.OK
            session.end(sid, code)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except FailedPrecondition as exc:  # this internal API's own status (as Decode's)
            code = grpc.StatusCode.FAILED_PRECONDITION
            session.end(sid, code, exc.message)
        except Exception as exc:  # noqa: BLE001 - the stream ends with its mapped status
            status = map_exception(exc, DECODE)
            code = status.code
            session.end(sid, code, status.message, status.trailing)
        finally:
            session.tasks.pop(sid, None)
            session.inputs.pop(sid, None)
            session.cancelled.discard(sid)
            session.ended[sid] = None
            if len(session.ended) > ENDED_KEPT:
                session.ended.popitem(last=False)
            session.wake.set()
            if self.metrics is not None and code not in (None, grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                self.metrics.error(code.name)
            record_call(self.metrics, DECODE, code, start)


async def _prepend(
    first: Any, queue: asyncio.Queue, waited: Callable[[float], None] | None = None
) -> AsyncIterator[pb.DecodeRequest]:
    """`first`, then the queue's messages (`Received`) until its requests are complete; each
    message's wait from its read off the call to the stream taking it goes to `waited`."""
    item = first
    while item is not _DONE_WRITING:
        if waited is not None:
            waited(max(time.perf_counter() - item.at, 0.0))
        yield item.response
        item = await queue.get()
