"""`talker.v1.TalkerService`: converts protobuf <-> domain objects around `TalkerCore`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from qtts.pb import talker_pb2, talker_pb2_grpc, tts_pb2
from qtts.request.errors import InvalidArgument, Unavailable
from qtts.request.sampling_pb import overrides_from_pb
from qtts.request.tts_enums import FINISH_TO_PB, TASK_FROM_PB
from qtts.request.vocabulary import AudioPiece, SynthesisSummary

from .core import TalkerCore
from .request import GenerationRequest
from .room import SeenCalls, published_room, watch_room
from .session import SessionServer


def request_from_proto(msg: talker_pb2.GenerateRequest) -> GenerationRequest:
    if msg.task_type not in TASK_FROM_PB:
        raise InvalidArgument(f"unknown task_type {msg.task_type}")
    sampling = overrides_from_pb(msg.sampling)
    return GenerationRequest(
        request_id=msg.request_id,
        text=msg.text,
        task=TASK_FROM_PB[msg.task_type],
        voice=msg.voice,
        language=msg.language,
        instructions=msg.instructions,
        reference_pcm_f32=msg.reference_pcm_f32,
        reference_digest=msg.reference_digest,
        reference_text=msg.reference_text,
        x_vector_only=msg.x_vector_only,
        sampling=sampling,
        max_new_frames=msg.max_new_frames,
        first_chunk_frames=msg.streaming.first_chunk_frames,
        chunk_frames_ramp=tuple(msg.streaming.chunk_frames_ramp),
        streaming_text=msg.streaming_text if msg.HasField("streaming_text") else None,
    )


def audio_message(
    request_id: str, seq: int, piece: AudioPiece, sample_rate_hz: int, cls: type = talker_pb2.GenerateResponse
) -> talker_pb2.GenerateResponse:
    return cls(
        request_id=request_id,
        sequence_number=seq,
        audio=tts_pb2.AudioChunk(
            audio=piece.pcm_s16le,
            num_samples=piece.num_samples,
            sample_rate_hz=sample_rate_hz,
            first_frame_index=piece.first_frame_index,
            num_frames=piece.num_frames,
        ),
    )


def summary_message(
    request_id: str, seq: int, summary: SynthesisSummary, cls: type = talker_pb2.GenerateResponse
) -> talker_pb2.GenerateResponse:
    return cls(
        request_id=request_id,
        sequence_number=seq,
        summary=talker_pb2.GenerateSummary(
            finish_reason=FINISH_TO_PB.get(summary.finish_reason, tts_pb2.FINISH_REASON_UNSPECIFIED),
            num_frames=summary.num_frames,
            num_samples=summary.num_samples,
            timings=tts_pb2.Timings(
                queue_ns=summary.queue_ns,
                prefill_ns=summary.prefill_ns,
                first_audio_ns=summary.first_audio_ns,
                total_ns=summary.total_ns,
            ),
            code2wav_replica=summary.code2wav_replica,
            num_input_tokens=summary.num_input_tokens,
        ),
    )


async def _appended_text(
    requests: AsyncIterator[talker_pb2.GenerateStreamRequest],
) -> AsyncIterator[tuple[str, bool]]:
    """(text, final) of the GenerateStream messages after the first."""
    async for msg in requests:
        if not msg.HasField("append"):
            raise InvalidArgument("start is only allowed in the first GenerateStreamRequest", param="start")
        yield msg.append.text, msg.append.final
        if msg.append.final:
            return


class TalkerServicer(talker_pb2_grpc.TalkerServiceServicer):
    """Generate streams a request's audio then its summary (Session: many requests on one call);
    GetModelInfo describes the model; GetCapacity says how many more requests it would take now."""

    def __init__(
        self, core: TalkerCore | None = None, sample_rate_hz: int = 24000, room_share_floor: float = 0.0
    ):
        # None until the model is loaded: the server registers the servicer before it starts.
        self.core = core
        self._sample_rate_hz = sample_rate_hz
        # Each gateway's calls seen, published with the room, and its share of it (room.py).
        self.seen = SeenCalls(share_floor=room_share_floor)
        # Set when the talker drains: WatchCapacity calls end instead of holding the drain, and
        # Session calls once their streams have.
        self.stopping = asyncio.Event()
        self.sessions = SessionServer(
            lambda request, text: self._generate(request, text, talker_pb2.GenerateResponse),
            self.seen,
            self.stopping,
        )

    def drain(self) -> None:
        self.stopping.set()
        self.sessions.wake_all()

    def _ready_core(self) -> TalkerCore:
        if self.core is None:
            raise Unavailable("the talker is still loading its model")
        return self.core

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: talker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[talker_pb2.GenerateResponse]:
        self.seen.saw(context.invocation_metadata())
        # aclosing: a cancelled call frees its stream when this closes, not when collected.
        async with contextlib.aclosing(self._generate(request, None, talker_pb2.GenerateResponse)) as msgs:
            async for msg in msgs:
                yield msg

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[talker_pb2.GenerateStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[talker_pb2.GenerateStreamResponse]:
        self.seen.saw(context.invocation_metadata())
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None or not first.HasField("start"):
            raise InvalidArgument("the first GenerateStreamRequest must carry start", param="start")
        msgs = self._generate(first.start, _appended_text(requests), talker_pb2.GenerateStreamResponse)
        async with contextlib.aclosing(msgs):
            async for msg in msgs:
                yield msg

    async def Session(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[talker_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[talker_pb2.SessionResponse]:
        async with contextlib.aclosing(self.sessions.serve(request_iterator)) as msgs:
            async for msg in msgs:
                yield msg

    async def _generate(
        self, request: talker_pb2.GenerateRequest, text: AsyncIterator[tuple[str, bool]] | None, cls: type
    ) -> AsyncIterator[Any]:
        req = request_from_proto(request)
        if not req.request_id:
            req = dataclasses.replace(req, request_id=uuid.uuid4().hex)
        async with contextlib.aclosing(self._ready_core().generate(req, text)) as items:
            seq = 0
            async for item in items:
                if isinstance(item, AudioPiece):
                    yield audio_message(req.request_id, seq, item, self._sample_rate_hz, cls)
                else:
                    yield summary_message(req.request_id, seq, item, cls)
                seq += 1

    async def GetModelInfo(  # noqa: N802 - gRPC method name
        self, request: talker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> talker_pb2.GetModelInfoResponse:
        info = self._ready_core().info
        return talker_pb2.GetModelInfoResponse(
            name=info.name,
            model_type=info.model_type,
            model_size=str(info.model_size),
            speakers=sorted(info.speakers),
            languages=sorted(info.languages),
            sample_rate_hz=info.sample_rate,
            samples_per_frame=info.samples_per_frame,
            num_codebooks=info.num_codebooks,
        )

    async def GetCapacity(  # noqa: N802 - gRPC method name
        self, request: talker_pb2.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> talker_pb2.GetCapacityResponse:
        core = self._ready_core()
        msg = await published_room(core.headroom, self.seen, request.caller, core.observe_room_worked_out)
        core.observe_published_room(msg.accept)
        return msg

    async def WatchCapacity(  # noqa: N802 - gRPC method name
        self, request: talker_pb2.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[talker_pb2.GetCapacityResponse]:
        core = self._ready_core()
        async with contextlib.aclosing(
            watch_room(
                core.headroom,
                self.seen,
                request.caller,
                self.stopping,
                observe=core.observe_room_worked_out,
                news=core.room_news,
            )
        ) as msgs:
            async for msg in msgs:
                core.observe_published_room(msg.accept)
                yield msg
