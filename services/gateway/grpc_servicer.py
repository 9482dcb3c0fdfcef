"""`tts.v1.TextToSpeechService`: a thin protobuf front end over the shared synthesis core."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc

from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.request.errors import Cancelled, InvalidArgument, TTSError
from qtts.request.sampling_overrides import SamplingOverrides, http_name
from qtts.request.sampling_pb import overrides_from_pb
from qtts.request.tts_enums import FINISH_TO_PB, TASK_FROM_PB
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE, SynthesisSummary

from .aligner_client import AlignerClient, check_alignable
from .audio_output import AudioOutput
from .auth import ApiKeys, grpc_owner, owner_var
from .client_identity import client_var, grpc_client_key
from .consents import ConsentStore
from .core import GatewayCore, SynthesisStream
from .grpc_text_input import END_OF_INPUT, TEXT_SPLITS, first_config, read_text
from .instructions import ignored_fields_header
from .job import SpeechFields, SynthesisJob
from .text_stream import SegmentText, TextBudget, TextSplitter, check_session, open_segment
from .validation import new_request_id
from .voice_client import VoiceInfo
from .voices import VoiceService

_ENCODINGS = {
    tts_pb2.AUDIO_ENCODING_UNSPECIFIED: "pcm",
    tts_pb2.AUDIO_ENCODING_PCM_S16LE: "pcm",
    tts_pb2.AUDIO_ENCODING_WAV: "wav",
}
# Errors name a field as the HTTP API spells it (`param`); a gRPC caller's google.rpc.BadRequest
# names the field of its own request message instead.
_SYNTHESIZE_FIELDS = {
    "input": "text",
    "ref_audio": "reference_audio",
    "ref_text": "reference_text",
    "x_vector_only_mode": "x_vector_only",
    "max_new_tokens": "max_new_frames",
    "sample_rate": "sample_rate_hz",
    "response_format": "audio_encoding",
    # Every sampling field, under its HTTP name: sampling.<field> of tts.v1.SamplingParams.
    **{http_name(f.name): f"sampling.{f.name}" for f in dataclasses.fields(SamplingOverrides)},
    "first_chunk_frames": "streaming.first_chunk_frames",
    "chunk_frames_ramp": "streaming.chunk_frames_ramp",
}
_SYNTHESIZE_MESSAGE_FIELDS = frozenset(tts_pb2.SynthesizeRequest.DESCRIPTOR.fields_by_name)


def _grpc_field(param: str | None, streaming: bool = False) -> str | None:
    """The request message's field path for an error's `param`."""
    if param is None:
        return None
    if streaming and param == "input":
        return "input.text"
    field = _SYNTHESIZE_FIELDS.get(param, param)
    if streaming and field.split(".")[0] in _SYNTHESIZE_MESSAGE_FIELDS:
        return "streaming_config.synthesis." + field
    return field


def fields_from_pb(req: tts_pb2.SynthesizeRequest, streaming: bool = False) -> SpeechFields:
    """The typed request of a `tts.v1.SynthesizeRequest`; `streaming`: a StreamingSynthesize
    config's, whose text comes later, in input messages (`text` None)."""
    if req.task_type not in TASK_FROM_PB:
        raise InvalidArgument(f"unknown task_type {req.task_type}", param="task_type")
    sampling = overrides_from_pb(req.sampling)
    return SpeechFields(
        text=None if streaming else req.text,
        model=req.model,
        task=TASK_FROM_PB[req.task_type],
        voice=req.voice or None,
        language=req.language or None,
        instructions=req.instructions or None,
        reference_audio=req.reference_audio or None,
        reference_text=req.reference_text or None,
        x_vector_only=req.x_vector_only,
        max_new_frames=req.max_new_frames or None,
        sampling=sampling,
        sample_rate=req.sample_rate_hz or None,
        request_id=req.request_id,
        first_chunk_frames=req.streaming.first_chunk_frames,
        chunk_frames_ramp=tuple(req.streaming.chunk_frames_ramp),
    )


def _encoding(value: int) -> str:
    if value not in _ENCODINGS:
        raise InvalidArgument(f"unsupported audio_encoding {value}", param="audio_encoding")
    return _ENCODINGS[value]


async def _report_ignored(context: grpc.aio.ServicerContext, job: SynthesisJob) -> None:
    """Initial metadata naming the fields the served variant ignored (instructions.py)."""
    if job.ignored_fields:
        await context.send_initial_metadata(tuple(ignored_fields_header(job).items()))


def _summary_to_pb(s: SynthesisSummary, num_samples: int, rate: int) -> tts_pb2.SynthesisSummary:
    return tts_pb2.SynthesisSummary(
        finish_reason=FINISH_TO_PB.get(s.finish_reason, tts_pb2.FINISH_REASON_UNSPECIFIED),
        num_frames=s.num_frames,
        num_samples=num_samples,
        sample_rate_hz=rate,
        timings=tts_pb2.Timings(
            queue_ns=s.queue_ns, prefill_ns=s.prefill_ns, first_audio_ns=s.first_audio_ns, total_ns=s.total_ns
        ),
        num_input_tokens=s.num_input_tokens,
    )


def voice_to_pb(v: VoiceInfo) -> tts_pb2.Voice:
    return tts_pb2.Voice(
        name=v.name,
        kind=v.kind,
        reference_text=v.reference_text,
        x_vector_only=v.x_vector_only,
        reference_duration_s=v.reference_duration_s,
        created_unix_s=v.created_unix_s,
    )


@dataclasses.dataclass
class _Align:
    """Word timestamps of one call: the text being aligned (a segment's SegmentText while it
    streams) and where the next audio starts in the call's audio."""

    text: Any
    offset_s: float = 0.0


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServiceServicer):
    """Synthesize and the voices API; errors are raised as TTSError and mapped by the interceptor."""

    def __init__(
        self,
        synthesizer: GatewayCore,
        voices: VoiceService,
        api_keys: ApiKeys | None = None,
        write_timeout_s: float = 0.0,
        consents: ConsentStore | None = None,
        aligner: AlignerClient | None = None,
        idle_timeout_s: float = 30.0,
    ):
        self._synth = synthesizer
        # The aligner stage; None: word_timestamps is refused.
        self._aligner = aligner
        self._voices = voices
        self._api_keys = api_keys
        # What CreateVoice's `consent` is checked against (the HTTP API's records).
        self._consents = consents if consents is not None else ConsentStore()
        # A response write that does not complete this long ends the call (0 = never); see _write_all.
        self._write_timeout_s = write_timeout_s
        # A StreamingSynthesize call silent this long while nothing is synthesised ends (0 = never).
        self._idle_timeout_s = idle_timeout_s

    def _bind_caller(self, context: grpc.aio.ServicerContext) -> None:
        """The caller's client key and voice owner, for this call's task (no reset needed)."""
        keys_enabled = self._api_keys is not None and self._api_keys.enabled
        client_var.set(grpc_client_key(context, keys_enabled))
        if keys_enabled:
            owner_var.set(grpc_owner(context))  # the interceptor has checked the key

    async def _write_all(
        self, responses: AsyncIterator, context: grpc.aio.ServicerContext, streaming: bool = False
    ) -> None:
        """Write `responses` with context.write(), each watched by the write timeout.

        A write blocks while the client's flow-control window is full: a caller that never reads
        would hold its stream and admission slot for good. When a write has not completed within
        the timeout, the stream is closed at once (its slot is free for others) and the call ends
        with CANCELLED once that write completes, i.e. when the client reads again (or with the
        call, if the client goes away). The write is not cancelled: a cancelled write leaves the
        call without a status the client could ever read."""
        try:
            async for msg in responses:
                if self._write_timeout_s <= 0:
                    await context.write(msg)
                    continue
                write = asyncio.ensure_future(context.write(msg))
                await asyncio.wait({write}, timeout=self._write_timeout_s)
                if write.done():
                    write.result()
                    continue
                stalled = Cancelled(f"the client took no audio for {self._write_timeout_s:g} s")
                # Into the generator at its yield: its finally closes the stream and frees the slot.
                with contextlib.suppress(Exception):
                    await responses.athrow(stalled)
                with contextlib.suppress(Exception):
                    await write
                raise stalled
        except TTSError as exc:
            exc.param = _grpc_field(exc.param, streaming)
            raise
        finally:
            await responses.aclose()

    async def Synthesize(self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream audio chunks, each with the request id and a sequence number, then a summary."""
        await self._write_all(self._synthesize(request, context), context)

    async def StreamingSynthesize(
        self,
        request_iterator: AsyncIterator[tts_pb2.StreamingSynthesizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Text in as it is produced, audio out per segment: segment_start, audio chunks, segment_summary.

        A segment (by default everything up to a flush or the end of input) is one running
        talker request that takes its text as it arrives; segments run in order. An error in any
        of them ends the call with its status (the segments before it were delivered whole)."""
        await self._write_all(self._streaming_synthesize(request_iterator, context), context, streaming=True)

    async def _synthesize(
        self, request: tts_pb2.SynthesizeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        self._bind_caller(context)
        try:
            # Known without the request's fields (the stream limit, the talkers' published room):
            # refused before they are copied and checked, as HTTP refuses before reading its body.
            if (busy := self._synth.early_refusal()) is not None:
                raise busy
            fmt = _encoding(request.audio_encoding)
            job = self._synth.validate(fields_from_pb(request))
            if request.word_timestamps:
                self._check_word_timestamps(job.language)
        except Exception as exc:
            self._synth.reject("grpc", exc)
            raise
        await _report_ignored(context, job)
        stream = await self._synth.open(job, "grpc")
        error: BaseException | None = None
        align = _Align(job.text) if request.word_timestamps else None
        try:
            async with contextlib.aclosing(self._responses(stream, fmt, align)) as msgs:
                async for msg in msgs:
                    yield msg
        except BaseException as exc:
            error = exc
            raise
        finally:
            await stream.close(error)

    async def _streaming_synthesize(
        self,
        request_iterator: AsyncIterator[tts_pb2.StreamingSynthesizeRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tts_pb2.StreamingSynthesizeResponse]:
        requests = aiter(request_iterator)
        self._bind_caller(context)
        config, fmt, fields, session = await self._streaming_session(requests)
        await _report_ignored(context, session)
        request_id = config.synthesis.request_id or new_request_id()
        limits = self._synth.limits
        splitter = TextSplitter(TEXT_SPLITS[config.text_split], limits.max_input_chars)
        budget = TextBudget(limits.max_text_piece_chars, limits.max_utterance_chars, param="input.text")
        queue: asyncio.Queue = asyncio.Queue()
        current: list[SegmentText] = []  # the segment being synthesised
        reader = asyncio.create_task(
            read_text(requests, splitter, budget, queue, self._idle_timeout_s, lambda: bool(current))
        )
        seq = segment = 0
        align = _Align("") if config.synthesis.word_timestamps else None
        try:
            while (item := await queue.get()) is not END_OF_INPUT:
                if isinstance(item, BaseException):
                    raise item
                start = tts_pb2.SegmentStart(text=item.text)  # the text so far: more may follow
                yield tts_pb2.StreamingSynthesizeResponse(
                    request_id=request_id, sequence_number=seq, segment_index=segment, segment_start=start
                )
                seq += 1
                current[:] = [item]
                stream = await open_segment(self._synth, fields, item, f"{request_id}-{segment}", "grpc")
                error: BaseException | None = None
                if align is not None:
                    align.text = item
                try:
                    msgs = self._responses(stream, fmt, align)
                    async with contextlib.aclosing(msgs):
                        async for msg in msgs:
                            event = (
                                {"audio": msg.audio}
                                if msg.HasField("audio")
                                else {"segment_summary": msg.summary}
                            )
                            yield tts_pb2.StreamingSynthesizeResponse(
                                request_id=request_id, sequence_number=seq, segment_index=segment, **event
                            )
                            seq += 1
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    current.clear()
                    await stream.close(error)
                    item.close()  # ended, maybe before its text did: later text starts the next
                segment += 1
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _streaming_session(
        self, requests: AsyncIterator[tts_pb2.StreamingSynthesizeRequest]
    ) -> tuple[tts_pb2.StreamingSynthesizeConfig, str, SpeechFields, SynthesisJob]:
        """The first message's config, checked: (config, audio encoding, the fields without text,
        the session's job)."""
        try:
            config = await first_config(requests, self._idle_timeout_s)
            synthesis = config.synthesis
            if synthesis.text:
                raise InvalidArgument(
                    "streaming_config.synthesis.text must be empty: text comes in input messages",
                    param="text",
                )
            if config.text_split not in TEXT_SPLITS:
                raise InvalidArgument(f"unknown text_split {config.text_split}", param="text_split")
            fmt = _encoding(synthesis.audio_encoding)
            fields = fields_from_pb(synthesis, streaming=True)
            session = check_session(self._synth, fields, fmt)
            if synthesis.word_timestamps:
                self._check_word_timestamps(fields.language or "auto")
        except Exception as exc:
            self._synth.reject("grpc", exc)
            raise
        return config, fmt, fields, session

    def _check_word_timestamps(self, language: str) -> None:
        if self._aligner is None:
            raise InvalidArgument(
                "word_timestamps needs a forced aligner, which this server does not have",
                param="word_timestamps",
            )
        check_alignable(language)

    async def _word_timestamps(self, stream: SynthesisStream, align: _Align, output: AudioOutput) -> dict:
        """The summary's word_timestamps fields for what `output` kept of the talker's audio."""
        pcm = b"".join(output.native_pcm)
        text = align.text if isinstance(align.text, str) else align.text.text
        words = await self._aligner.try_align(
            stream.job.request_id, text, stream.job.language, pcm, offset_s=align.offset_s
        )
        align.offset_s += len(pcm) / 2 / NATIVE_SAMPLE_RATE
        if words is None:
            return {"word_timestamps_failed": True}
        return {"word_timestamps": [tts_pb2.WordTimestamp(**w) for w in words]}

    async def _responses(
        self, stream: SynthesisStream, fmt: str, align: _Align | None = None
    ) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        rate = stream.job.sample_rate
        align = align if self._aligner is not None else None
        output = AudioOutput(fmt, rate, keep_native=align is not None)
        seq = 0

        def response(**event) -> tts_pb2.SynthesizeResponse:
            nonlocal seq
            msg = tts_pb2.SynthesizeResponse(request_id=stream.job.request_id, sequence_number=seq, **event)
            seq += 1
            return msg

        async with contextlib.aclosing(output.chunks(stream)) as chunks:
            async for chunk in chunks:
                if chunk.data:
                    yield response(
                        audio=tts_pb2.AudioChunk(
                            audio=chunk.data,
                            num_samples=chunk.num_samples,
                            sample_rate_hz=rate,
                            first_frame_index=chunk.first_frame_index,
                            num_frames=chunk.num_frames,
                        )
                    )
                if chunk.last:
                    summary = _summary_to_pb(stream.summary, output.num_samples, rate)
                    if align is not None:
                        extra = await self._word_timestamps(stream, align, output)
                        summary.word_timestamps.extend(extra.get("word_timestamps", []))
                        summary.word_timestamps_failed = extra.get("word_timestamps_failed", False)
                    yield response(summary=summary)

    async def ListVoices(
        self, request: tts_pb2.ListVoicesRequest, context: grpc.aio.ServicerContext
    ) -> tts_pb2.ListVoicesResponse:
        """Cloned voices from speaker_cache and the model's preset speakers."""
        self._bind_caller(context)
        return tts_pb2.ListVoicesResponse(voices=[voice_to_pb(v) for v in await self._voices.list()])

    async def CreateVoice(
        self, request: tts_pb2.CreateVoiceRequest, context: grpc.aio.ServicerContext
    ) -> tts_pb2.CreateVoiceResponse:
        """Store a reference clip (any container) under a name; without a transcript (and without
        x_vector_only set) the voice is x-vector only, as over HTTP."""
        self._bind_caller(context)
        x_vector_only = request.x_vector_only if request.HasField("x_vector_only") else None
        try:
            await self._consents.check(request.consent)
            voice = await self._voices.create(
                request.name,
                request.reference_audio,
                request.reference_text,
                x_vector_only,
                audio_field="reference_audio",
            )
        except TTSError as exc:
            exc.param = _grpc_field(exc.param)
            raise
        return tts_pb2.CreateVoiceResponse(voice=voice_to_pb(voice))

    async def GetVoice(
        self, request: tts_pb2.GetVoiceRequest, context: grpc.aio.ServicerContext
    ) -> tts_pb2.GetVoiceResponse:
        """One stored voice (with its clip's duration) or preset speaker."""
        self._bind_caller(context)
        return tts_pb2.GetVoiceResponse(voice=voice_to_pb(await self._voices.get(request.name)))

    async def DeleteVoice(
        self, request: tts_pb2.DeleteVoiceRequest, context: grpc.aio.ServicerContext
    ) -> tts_pb2.DeleteVoiceResponse:
        self._bind_caller(context)
        await self._voices.delete(request.name)
        return tts_pb2.DeleteVoiceResponse()
