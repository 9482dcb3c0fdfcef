"""`code2wav.v1.Code2WavService/Decode`: converts protobuf to `Code2WavCore` calls and back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np

from qtts.pb import code2wav_pb2 as pb
from qtts.pb import code2wav_pb2_grpc
from qtts.request.errors import FailedPrecondition, InvalidArgument, TTSError
from qtts.streams.decode_events import Credit, DecodedAudio, DecodeEvent, Done
from services.code2wav.core import Code2WavCore
from services.code2wav.decode_cost import DecodeCostEstimate
from services.code2wav.session import DecodeSessionServer
from services.code2wav.stream import DecodeStream


def codes_from_bytes(data: bytes, num_frames: int, num_codebooks: int, what: str) -> np.ndarray:
    """int16 LE row-major [num_frames, num_codebooks]; INVALID_ARGUMENT when the sizes disagree."""
    expected = 2 * num_frames * num_codebooks
    if len(data) != expected:
        raise InvalidArgument(
            f"{what}: {len(data)} bytes for {num_frames} frames x {num_codebooks} codebooks, expected {expected}"
        )
    return np.frombuffer(data, dtype="<i2").reshape(num_frames, num_codebooks)


def event_to_pb(
    stream_id: str, seq: int, event: DecodeEvent, cost: DecodeCostEstimate | None = None
) -> pb.DecodeResponse:
    """The message of `event`; a credit grant also carries the replica's decode `cost`."""
    if isinstance(event, Credit):
        grant = pb.CreditGrant(
            frames_allowed_until=event.frames_allowed_until,
            first_chunk_frames=event.plan.first if event.plan else 0,
            chunk_frames_ramp=event.plan.ramp if event.plan else (),
            cuts_at_flush=event.cuts_at_flush,
        )
        if cost is not None:
            grant.decode_frame_ns = round(cost.frame_s * 1e9)
            grant.decode_call_ns = round(cost.call_s * 1e9)
            grant.decode_calls_per_s = cost.calls_per_s
        return pb.DecodeResponse(stream_id=stream_id, sequence_number=seq, credit=grant)
    if isinstance(event, DecodedAudio):
        audio = pb.AudioOut(
            pcm_s16le=event.pcm_s16le,
            num_samples=event.num_samples,
            first_frame_index=event.first_frame_index,
            num_frames=event.num_frames,
            decode_ns=event.decode_ns,
            held_ns=event.held_ns,
        )
        return pb.DecodeResponse(stream_id=stream_id, sequence_number=seq, audio=audio)
    assert isinstance(event, Done)
    done = pb.StreamDone(num_frames=event.num_frames, num_samples=event.num_samples, replica=event.replica)
    return pb.DecodeResponse(stream_id=stream_id, sequence_number=seq, done=done)


CANCEL_SETTLE_S = 0.5


class Code2WavServicer(code2wav_pb2_grpc.Code2WavServiceServicer):
    """One Decode call = one stream: StreamStart, frame deltas, acks, StreamEnd in; grants, audio, done out.

    After StreamDone the client should half-close its request stream; the server then ends the
    call with OK (it ends it anyway after `close_wait_s`).
    """

    def __init__(self, engine: Code2WavCore, close_wait_s: float = 2.0, metrics: Any = None):
        self.engine = engine
        self.close_wait_s = close_wait_s
        self.sessions = DecodeSessionServer(self._decode, metrics)

    async def DecodeSession(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.DecodeSessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeSessionResponse]:
        async with contextlib.aclosing(self.sessions.serve(request_iterator)) as responses:
            async for response in responses:
                yield response

    async def Decode(
        self, request_iterator: AsyncIterator[pb.DecodeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        try:
            # aclosing: a cancelled stream frees its decoder state when this closes, not when collected.
            async with contextlib.aclosing(self._decode(request_iterator, context.cancelled)) as responses:
                async for response in responses:
                    yield response
        except FailedPrecondition as exc:
            # Not in the shared error table: this status only exists on this internal API.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.message)

    async def _decode(
        self, request_iterator: AsyncIterator[pb.DecodeRequest], cancelled: Callable[[], bool] = lambda: False
    ) -> AsyncIterator[pb.DecodeResponse]:
        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("event") != "start":
            raise FailedPrecondition(
                f"the first message must be StreamStart, got {first.WhichOneof('event')}"
            )
        start = first.start
        prefix = None
        if start.num_prefix_frames or start.prefix_codes_i16:
            prefix = codes_from_bytes(
                start.prefix_codes_i16, start.num_prefix_frames, start.num_codebooks, "prefix"
            )
        stream = await self.engine.open_stream(
            start.request_id,
            start.num_codebooks,
            prefix,
            start.first_chunk_frames,
            list(start.chunk_frames_ramp),
        )
        reader = asyncio.create_task(self._read(requests, stream, cancelled))
        seq = 0
        try:
            cost = getattr(self.engine, "cost", None)
            async with contextlib.aclosing(stream.events()) as events:
                async for event in events:
                    seq += 1
                    estimate = cost.estimate() if cost is not None and isinstance(event, Credit) else None
                    yield event_to_pb(stream.stream_id, seq, event, estimate)
            self.engine.release(stream)
            # The client may still send an ack it wrote before it saw StreamDone; closing now would
            # fail that write on its side. Wait (bounded) for it to half-close its request stream.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.close_wait_s):  # not wait_for: it can swallow a cancel
                    await asyncio.shield(reader)
        finally:
            # Free first: nothing below may be skipped by a second cancellation.
            self.engine.release(stream)
            reader.cancel()

    async def _read(
        self,
        requests: AsyncIterator[pb.DecodeRequest],
        stream: DecodeStream,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Apply the client's messages to the stream; a violation ends this stream only."""
        nc = stream.codec_shape.num_codebooks
        try:
            async for req in requests:
                kind = req.WhichOneof("event")
                if kind == "frames":
                    codes = codes_from_bytes(req.frames.codes_i16, req.frames.num_frames, nc, "frames")
                    stream.add_frames(req.frames.first_frame_index, codes, req.frames.flush)
                    self.engine.notify(stream)
                elif kind == "ack":
                    stream.ack(req.ack.samples_delivered)
                elif kind == "end":
                    stream.end(req.end.total_frames)
                    self.engine.notify(stream)
                elif kind == "start":
                    raise FailedPrecondition("second StreamStart on one stream")
                else:
                    raise InvalidArgument("empty DecodeRequest")
            if stream.total_frames is None:
                # A caller's cancel (its client went away, or it failed) also reads as the end of the
                # requests, just before grpc cancels this call's handler (which cancels this task):
                # give it that moment rather than call a cancel a protocol violation, and fail no
                # call whose caller can read no status any more.
                await asyncio.sleep(CANCEL_SETTLE_S)
                if cancelled():
                    stream.fail(asyncio.CancelledError("the caller cancelled the stream"))
                    return
                raise FailedPrecondition("request stream closed before StreamEnd")
        except asyncio.CancelledError:
            raise
        except TTSError as exc:
            stream.fail(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. the call broke while reading
            stream.fail(exc)
