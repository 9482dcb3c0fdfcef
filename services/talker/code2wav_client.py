"""One stream's `Code2WavService/Decode` call, seen as numpy frames in and domain events out.

This adapter is the only talker module that touches the code2wav protobufs; the stream logic
(`stream.py`) works with the events below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from qtts.pb import code2wav_pb2, code2wav_pb2_grpc
from qtts.request.errors import TTSError, Unavailable, from_grpc
from qtts.serving.log_context import outgoing_metadata
from qtts.streams.chunk_plan import ChunkPlan
from qtts.streams.decode_events import Credit, DecodedAudio, Done

log = logging.getLogger(__name__)

# Status codes that mean the replica itself is gone or unreachable (not a verdict on the stream).
# CANCELLED comes from the server side only when it stopped under us: our own cancel ends reading.
REPLICA_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# The details grpc.aio gives a call whose operation failed inside the client's own core (the call
# or its connection died under it, as when the replica stops mid-stream): a status the replica
# never sent, however INTERNAL it reads.
CLIENT_CORE_FAILURE = "Internal error from Core"


@dataclass(frozen=True)
class DecodeFailed:
    """The call ended with an error; `replica_down` when the replica is unreachable or gone."""

    error: TTSError
    replica_down: bool


@dataclass(frozen=True)
class DecodeClosed:
    """The server closed the call without StreamDone."""


DecodeCallEvent = Credit | DecodedAudio | Done | DecodeFailed | DecodeClosed

# Where a replica's published decode cost goes: (replica, seconds per frame, seconds per call,
# calls per second).
CostSink = Callable[[str, float, float, float], None]


class DecoderCosts:
    """The decode cost every code2wav replica publishes on its grants, passed on to the engine's
    admission (`sink(frame_s, call_s, calls_per_s)`) when the decoder shares the talker's GPU.

    Replicas on one GPU add up: the slowest per-frame figure counts for every stream (a stream's
    replica is not known to admission), and each replica's per-call cost at its call rate adds a
    fixed share, passed as `call_s` with one call a second. The engine hears of it at most every
    `min_interval_s` (grants come by the thousand a second; the figures move slowly)."""

    def __init__(
        self,
        sink: Callable[[float, float, float], None],
        min_interval_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._sink = sink
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._by_replica: dict[str, tuple[float, float]] = {}  # replica -> (frame_s, call load)
        self._sent_at = -float("inf")
        self._logged: tuple[float, float, float] | None = None  # (at, frame_s, call load) last logged

    def observe(self, replica: str, frame_s: float, call_s: float, calls_per_s: float) -> None:
        if frame_s <= 0:
            return  # not measured yet
        self._by_replica[replica] = (frame_s, call_s * calls_per_s)
        now = self._clock()
        if now - self._sent_at < self._min_interval_s:
            return
        self._sent_at = now
        frame = max(f for f, _ in self._by_replica.values())
        load = sum(c for _, c in self._by_replica.values())
        self._sink(frame, load, 1.0)
        last = self._logged
        if last is None or (now - last[0] >= 10.0 and abs(frame - last[1]) > 0.1 * last[1]):
            self._logged = (now, frame, load)
            log.info(
                "code2wav's decode cost on this GPU: %.1f us a frame, per-call load %.1f%% (%d replicas)",
                frame * 1e6,
                load * 100,
                len(self._by_replica),
            )


def _error(replica: str, exc: grpc.aio.AioRpcError) -> DecodeFailed:
    code = exc.code()
    if code in REPLICA_DOWN_CODES or (
        code == grpc.StatusCode.INTERNAL and exc.details() == CLIENT_CORE_FAILURE
    ):
        return DecodeFailed(
            Unavailable(f"code2wav replica {replica} went away or is unreachable: {exc.details()}"), True
        )
    err = from_grpc(code, f"code2wav replica {replica}: {exc.details()}")
    return DecodeFailed(err, False)


def event_of(
    msg: code2wav_pb2.DecodeResponse, replica: str, on_cost: CostSink | None, received_at: float = 0.0
) -> Credit | DecodedAudio | Done | None:
    """The domain event of a Decode response (a grant's decode cost goes to `on_cost`; audio read
    off its call at `received_at`, time.perf_counter)."""
    kind = msg.WhichOneof("event")
    if kind == "credit":
        c = msg.credit
        plan = ChunkPlan(c.first_chunk_frames, tuple(c.chunk_frames_ramp)) if c.first_chunk_frames else None
        if on_cost is not None and c.decode_frame_ns:
            on_cost(replica, c.decode_frame_ns / 1e9, c.decode_call_ns / 1e9, c.decode_calls_per_s)
        return Credit(c.frames_allowed_until, plan, c.cuts_at_flush)
    if kind == "audio":
        a = msg.audio
        return DecodedAudio(
            a.pcm_s16le, a.num_samples, a.first_frame_index, a.num_frames, a.decode_ns, a.held_ns, received_at
        )
    if kind == "done":
        return Done(msg.done.num_frames, msg.done.num_samples, msg.done.replica)
    return None


def start_request(
    request_id: str,
    num_codebooks: int,
    prefix_codes: np.ndarray | None,
    first_chunk_frames: int,
    chunk_frames_ramp: Sequence[int],
) -> code2wav_pb2.DecodeRequest:
    start = code2wav_pb2.StreamStart(
        request_id=request_id,
        num_codebooks=num_codebooks,
        first_chunk_frames=first_chunk_frames,
        chunk_frames_ramp=list(chunk_frames_ramp),
    )
    if prefix_codes is not None and len(prefix_codes):
        start.prefix_codes_i16 = np.ascontiguousarray(prefix_codes, dtype="<i2").tobytes()
        start.num_prefix_frames = int(prefix_codes.shape[0])
    return code2wav_pb2.DecodeRequest(start=start)


def frames_request(
    first_frame_index: int, codes: np.ndarray, flush: bool = False
) -> code2wav_pb2.DecodeRequest:
    delta = code2wav_pb2.FrameDelta(
        first_frame_index=first_frame_index,
        num_frames=int(codes.shape[0]),
        codes_i16=np.ascontiguousarray(codes, dtype="<i2").tobytes(),
        flush=flush,
    )
    return code2wav_pb2.DecodeRequest(frames=delta)


class DecodeCall:
    """A `Decode` bidi call on one replica; writes must come from one task at a time."""

    def __init__(
        self, stub: code2wav_pb2_grpc.Code2WavServiceStub, replica: str, on_cost: CostSink | None = None
    ):
        self.replica = replica
        self._on_cost = on_cost  # gets the decode cost the replica publishes on its grants
        # The request id bound for the talker's call (qtts.serving.log_context) reaches code2wav's logs.
        self._call = stub.Decode(metadata=outgoing_metadata())
        self._finished = False

    async def start(
        self,
        request_id: str,
        num_codebooks: int,
        prefix_codes: np.ndarray | None,
        first_chunk_frames: int,
        chunk_frames_ramp: Sequence[int],
    ) -> None:
        await self._write(
            start_request(request_id, num_codebooks, prefix_codes, first_chunk_frames, chunk_frames_ramp)
        )

    async def send_frames(self, first_frame_index: int, codes: np.ndarray, flush: bool = False) -> None:
        """Send frames [first, first + len(codes)); `codes` is int [n, num_codebooks]. `flush`:
        decode them now, though their chunk is not complete (FrameDelta.flush)."""
        await self._write(frames_request(first_frame_index, codes, flush))

    async def end(self, total_frames: int) -> None:
        await self._write(code2wav_pb2.DecodeRequest(end=code2wav_pb2.StreamEnd(total_frames=total_frames)))
        await self._call.done_writing()

    async def ack(self, samples_delivered: int) -> None:
        try:
            await self._write(
                code2wav_pb2.DecodeRequest(ack=code2wav_pb2.AudioAck(samples_delivered=samples_delivered))
            )
        except TTSError:
            # The server may close right after its last chunk; an ack it no longer reads is harmless.
            pass

    async def _write(self, message: code2wav_pb2.DecodeRequest) -> None:
        try:
            await self._call.write(message)
        except grpc.aio.AioRpcError as exc:
            raise _error(self.replica, exc).error from exc
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            raise Unavailable(f"code2wav replica {self.replica} closed the stream") from exc

    async def events(self) -> AsyncIterator[DecodeCallEvent]:
        """Server messages as domain events; always ends with Done, DecodeFailed or DecodeClosed."""
        try:
            async for msg in self._call:
                event = event_of(msg, self.replica, self._on_cost, time.perf_counter())
                if event is not None:
                    yield event
                if isinstance(event, Done):
                    self._finished = True
                    return
        except grpc.aio.AioRpcError as exc:
            self._finished = True
            yield _error(self.replica, exc)
            return
        self._finished = True
        yield DecodeClosed()

    def cancel(self) -> None:
        """Cancel the call (frees the decoder state on the replica); a no-op once it ended."""
        if not self._call.done():
            self._call.cancel()
