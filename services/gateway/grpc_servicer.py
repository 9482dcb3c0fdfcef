"""`tts.v1.TextToSpeechService`: a thin protobuf front end over the shared synthesis core."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from qtts.errors import InvalidArgument
from qtts.pb import tts_pb2, tts_pb2_grpc
from qtts.sampling_overrides import overrides_from_pb
from qtts.tts_enums import FINISH_TO_PB, TASK_FROM_PB

from .audio_encoding import Resampler, make_encoder
from .job import AudioPiece, SpeechFields, SynthesisSummary
from .synthesis import SynthesisStream, Synthesizer
from .voice_client import VoiceInfo
from .voices import VoiceService

_ENCODINGS = {
    tts_pb2.AUDIO_ENCODING_UNSPECIFIED: "pcm",
    tts_pb2.AUDIO_ENCODING_PCM_S16LE: "pcm",
    tts_pb2.AUDIO_ENCODING_WAV: "wav",
}


def fields_from_pb(req: tts_pb2.SynthesizeRequest) -> SpeechFields:
    if req.task_type not in TASK_FROM_PB:
        raise InvalidArgument(f"unknown task_type {req.task_type}")
    sampling = overrides_from_pb(req.sampling)
    return SpeechFields(
        text=req.text,
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


def voice_to_pb(v: VoiceInfo) -> tts_pb2.Voice:
    return tts_pb2.Voice(
        name=v.name, kind=v.kind, reference_text=v.reference_text, x_vector_only=v.x_vector_only,
        reference_duration_s=v.reference_duration_s, created_unix_s=v.created_unix_s,
    )


class TextToSpeechServicer(tts_pb2_grpc.TextToSpeechServiceServicer):
    """Synthesize and the voices API; errors are raised as TTSError and mapped by the interceptor."""

    def __init__(self, synthesizer: Synthesizer, voices: VoiceService):
        self._synth = synthesizer
        self._voices = voices

    async def Synthesize(self, request: tts_pb2.SynthesizeRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        """Stream audio chunks, each with the request id and a sequence number, then a summary."""
        try:
            if request.audio_encoding not in _ENCODINGS:
                raise InvalidArgument(f"unsupported audio_encoding {request.audio_encoding}")
            job = self._synth.validate(fields_from_pb(request))
        except Exception as exc:
            self._synth.reject("grpc", exc)
            raise
        stream = await self._synth.open(job, "grpc")
        error: BaseException | None = None
        try:
            async for msg in self._responses(stream, _ENCODINGS[request.audio_encoding]):
                yield msg
        except BaseException as exc:
            error = exc
            raise
        finally:
            await stream.close(error)

    async def _responses(self, stream: SynthesisStream, fmt: str) -> AsyncIterator[tts_pb2.SynthesizeResponse]:
        rate = stream.job.sample_rate
        encoder = make_encoder(fmt, rate, streaming=True)
        resampler = Resampler(24000, rate)
        seq = 0
        samples_out = 0
        next_frame = 0

        def response(**event) -> tts_pb2.SynthesizeResponse:
            nonlocal seq
            msg = tts_pb2.SynthesizeResponse(request_id=stream.job.request_id, sequence_number=seq, **event)
            seq += 1
            return msg

        async for event in stream:
            if isinstance(event, AudioPiece):
                pcm = resampler.push(event.pcm)
                data = encoder.push(pcm)
                samples_out += len(pcm) // 2
                next_frame = event.first_frame_index + event.num_frames
                if data:
                    yield response(audio=tts_pb2.AudioChunk(
                        audio=data, num_samples=len(pcm) // 2, sample_rate_hz=rate,
                        first_frame_index=event.first_frame_index, num_frames=event.num_frames,
                    ))
                    stream.first_byte_sent()
            elif isinstance(event, SynthesisSummary):
                pcm = resampler.flush()
                tail = encoder.push(pcm) + encoder.finish()
                samples_out += len(pcm) // 2
                if tail:
                    yield response(audio=tts_pb2.AudioChunk(
                        audio=tail, num_samples=len(pcm) // 2, sample_rate_hz=rate,
                        first_frame_index=next_frame, num_frames=0,
                    ))
                yield response(summary=tts_pb2.SynthesisSummary(
                    finish_reason=FINISH_TO_PB.get(event.finish_reason, tts_pb2.FINISH_REASON_UNSPECIFIED),
                    num_frames=event.num_frames,
                    num_samples=samples_out,
                    sample_rate_hz=rate,
                    timings=tts_pb2.Timings(queue_ns=event.queue_ns, prefill_ns=event.prefill_ns,
                                            first_audio_ns=event.first_audio_ns, total_ns=event.total_ns),
                    num_input_tokens=event.num_input_tokens,
                ))

    async def ListVoices(self, request: tts_pb2.ListVoicesRequest,
                         context: grpc.aio.ServicerContext) -> tts_pb2.ListVoicesResponse:
        """Cloned voices from speaker_cache and the model's preset speakers."""
        return tts_pb2.ListVoicesResponse(voices=[voice_to_pb(v) for v in await self._voices.list()])

    async def CreateVoice(self, request: tts_pb2.CreateVoiceRequest,
                          context: grpc.aio.ServicerContext) -> tts_pb2.CreateVoiceResponse:
        """Store a reference clip (any container) and its transcript under a name."""
        voice = await self._voices.create(request.name, request.reference_audio, request.reference_text,
                                          request.x_vector_only)
        return tts_pb2.CreateVoiceResponse(voice=voice_to_pb(voice))

    async def DeleteVoice(self, request: tts_pb2.DeleteVoiceRequest,
                          context: grpc.aio.ServicerContext) -> tts_pb2.DeleteVoiceResponse:
        await self._voices.delete(request.name)
        return tts_pb2.DeleteVoiceResponse()
