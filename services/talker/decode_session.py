"""The talker's end of `code2wav.v1.Code2WavService/DecodeSession`: many Decode streams on one
call per replica (see the proto and services/code2wav/session.py).

`ReplicaSession` keeps a DecodeSession call on a replica's channel; every stream's messages of a
loop turn (starts, frame deltas, acks, ends, cancels) go in one message. `SessionDecodeCall` is a
stream on it with `DecodeCall`'s interface, so `ReplicaLink` uses either. Which call a stream
goes on is `qtts.serving.session_calls`: one that has answered (until then, and for good on a
replica that answers UNIMPLEMENTED, streams get a Decode call each), rotated every `rotate_s`.
When the session call fails, every stream on it fails with that status (a dead replica:
`DecodeFailed` with `replica_down`, which the stream's failover handles).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np

from qtts.pb import code2wav_pb2, code2wav_pb2_grpc
from qtts.request.errors import TTSError, Unavailable
from qtts.serving.session_calls import ClientCall, Failed, Received, SessionCalls, end_error

from . import code2wav_client as c2w

ROTATE_S = 30.0
DECODE_SESSION = "/code2wav.v1.Code2WavService/DecodeSession"


class ReplicaSession:
    """The DecodeSession calls on one replica (qtts.serving.session_calls)."""

    def __init__(
        self,
        stub: code2wav_pb2_grpc.Code2WavServiceStub,
        rotate_s: float = ROTATE_S,
        clock=time.monotonic,
        on_written: Callable[[float], None] | None = None,
    ):
        """`on_written(seconds)`: each message's write time (ClientCall)."""
        self._calls: SessionCalls[_SessionCall] = SessionCalls(
            lambda now: _SessionCall(stub, now, on_written), rotate_s, clock
        )
        self._ids = itertools.count(1)

    @property
    def unimplemented(self) -> bool:
        return self._calls.unimplemented

    def open(self, replica: str, on_cost: c2w.CostSink | None) -> SessionDecodeCall | None:
        """A new stream on the session call in use, or None while none has answered yet (one is
        opened meanwhile): the stream then gets a Decode call of its own."""
        call = self._calls.current()
        return None if call is None else SessionDecodeCall(call, next(self._ids), replica, on_cost)

    async def close(self) -> None:
        await self._calls.close()


class _SessionCall(ClientCall):
    """One DecodeSession call: its streams, and their messages, done-writings and cancels to send."""

    gone = "the talker closed the session"

    def __init__(
        self,
        stub: code2wav_pb2_grpc.Code2WavServiceStub,
        started: float,
        on_written: Callable[[float], None] | None = None,
    ):
        self._messages: list[code2wav_pb2.DecodeSessionMessage] = []
        self._done_writing: list[int] = []
        super().__init__(stub.DecodeSession, started, on_written)

    def send(self, sid: int, request: code2wav_pb2.DecodeRequest) -> None:
        self._messages.append(code2wav_pb2.DecodeSessionMessage(stream_id=sid, request=request))
        self.wake()

    def done_writing(self, sid: int) -> None:
        self._done_writing.append(sid)
        self.wake()

    def _take(self) -> code2wav_pb2.DecodeSessionRequest | None:
        if not (self._messages or self._done_writing or self._cancels):
            return None
        msg = code2wav_pb2.DecodeSessionRequest(
            messages=self._messages, done_writing=self._done_writing, cancel=self.take_cancels()
        )
        self._messages, self._done_writing = [], []
        return msg


class SessionDecodeCall:
    """One stream on a replica's DecodeSession, with `DecodeCall`'s interface."""

    def __init__(self, call: _SessionCall, sid: int, replica: str, on_cost: c2w.CostSink | None):
        self.replica = replica
        self._session = call
        self._sid = sid
        self._on_cost = on_cost
        self._queue: asyncio.Queue = asyncio.Queue()
        call.streams[sid] = self._queue
        self._finished = False
        self._writing = True

    def _send(self, request: code2wav_pb2.DecodeRequest) -> None:
        if self._session.ended or self._sid not in self._session.streams:
            raise Unavailable(f"code2wav replica {self.replica} closed the stream")
        self._session.send(self._sid, request)

    async def start(
        self,
        request_id: str,
        num_codebooks: int,
        prefix_codes: np.ndarray | None,
        first_chunk_frames: int,
        chunk_frames_ramp: Sequence[int],
    ) -> None:
        self._send(
            c2w.start_request(request_id, num_codebooks, prefix_codes, first_chunk_frames, chunk_frames_ramp)
        )

    async def send_frames(self, first_frame_index: int, codes: np.ndarray, flush: bool = False) -> None:
        self._send(c2w.frames_request(first_frame_index, codes, flush))

    async def end(self, total_frames: int) -> None:
        self._send(code2wav_pb2.DecodeRequest(end=code2wav_pb2.StreamEnd(total_frames=total_frames)))
        self._writing = False
        self._session.done_writing(self._sid)

    async def ack(self, samples_delivered: int) -> None:
        if not self._writing:  # as a Decode call's ack after its half-close: not sent (a message
            return  # for a stream the replica may have closed would start a stream there)
        with contextlib.suppress(TTSError):  # after its end, an ack no longer read is harmless
            self._send(
                code2wav_pb2.DecodeRequest(ack=code2wav_pb2.AudioAck(samples_delivered=samples_delivered))
            )

    async def events(self) -> AsyncIterator[c2w.DecodeCallEvent]:
        """As `DecodeCall.events`: always ends with Done, DecodeFailed or DecodeClosed."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, Received):
                    event = c2w.event_of(item.response, self.replica, self._on_cost, item.at)
                    if event is not None:
                        yield event
                    if isinstance(event, c2w.Done):
                        self._finished = True
                        if self._writing:  # as a Decode caller half-closes after StreamDone
                            self._writing = False
                            self._session.done_writing(self._sid)
                        return
                    continue
                self._finished = True
                if isinstance(item, Failed):
                    yield c2w._error(self.replica, item.error)
                elif item.code != 0:
                    yield c2w._error(self.replica, end_error(item))
                else:
                    yield c2w.DecodeClosed()
                return
        finally:
            if self._finished:
                self._session.forget(self._sid, cancel=False)

    def cancel(self) -> None:
        """Cancel the stream (frees its decoder state on the replica); a no-op once it ended."""
        self._finished = True
        self._session.forget(self._sid, cancel=True)
