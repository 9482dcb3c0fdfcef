"""`speaker_cache.v1.SpeakerCacheService`: converts protobuf to records and calls `SpeakerCache`."""

from __future__ import annotations

import grpc

from qtts.pb import speaker_cache_pb2 as pb
from qtts.pb import speaker_cache_pb2_grpc
from services.speaker_cache.cache import SpeakerCache
from services.speaker_cache.records import PromptRecord, VoiceRecord


def prompt_from_pb(p: pb.VoicePrompt) -> PromptRecord:
    return PromptRecord(
        model_id=p.model_id,
        x_vector_f32=p.x_vector_f32,
        x_vector_dim=p.x_vector_dim,
        reference_codes_i16=p.reference_codes_i16,
        num_reference_frames=p.num_reference_frames,
        num_codebooks=p.num_codebooks,
        reference_text=p.reference_text,
        x_vector_only=p.x_vector_only,
    )


def prompt_to_pb(r: PromptRecord) -> pb.VoicePrompt:
    return pb.VoicePrompt(
        model_id=r.model_id,
        x_vector_f32=r.x_vector_f32,
        x_vector_dim=r.x_vector_dim,
        reference_codes_i16=r.reference_codes_i16,
        num_reference_frames=r.num_reference_frames,
        num_codebooks=r.num_codebooks,
        reference_text=r.reference_text,
        x_vector_only=r.x_vector_only,
    )


def voice_from_pb(v: pb.StoredVoice) -> VoiceRecord:
    return VoiceRecord(
        name=v.name,
        reference_pcm_f32=v.reference_pcm_f32,
        sample_rate_hz=v.sample_rate_hz,
        reference_text=v.reference_text,
        x_vector_only=v.x_vector_only,
        created_unix_s=v.created_unix_s,
    )


def voice_to_pb(r: VoiceRecord) -> pb.StoredVoice:
    return pb.StoredVoice(
        name=r.name,
        reference_pcm_f32=r.reference_pcm_f32,
        sample_rate_hz=r.sample_rate_hz,
        reference_text=r.reference_text,
        x_vector_only=r.x_vector_only,
        created_unix_s=r.created_unix_s,
    )


class SpeakerCacheServicer(speaker_cache_pb2_grpc.SpeakerCacheServiceServicer):
    """Thin gRPC adapter; domain errors become status codes in the server's interceptor."""

    def __init__(self, cache: SpeakerCache):
        self.cache = cache

    async def GetVoicePrompt(self, request: pb.GetVoicePromptRequest, context: grpc.aio.ServicerContext):
        prompt = await self.cache.get_prompt(request.key)
        if prompt is None:
            return pb.GetVoicePromptResponse(found=False)
        return pb.GetVoicePromptResponse(found=True, prompt=prompt_to_pb(prompt))

    async def PutVoicePrompt(self, request: pb.PutVoicePromptRequest, context: grpc.aio.ServicerContext):
        await self.cache.put_prompt(request.key, prompt_from_pb(request.prompt))
        return pb.PutVoicePromptResponse()

    async def CreateVoice(self, request: pb.CreateVoiceRequest, context: grpc.aio.ServicerContext):
        voice = await self.cache.create_voice(voice_from_pb(request.voice), overwrite=request.overwrite)
        return pb.CreateVoiceResponse(voice=voice_to_pb(voice.without_audio()))

    async def GetVoice(self, request: pb.GetVoiceRequest, context: grpc.aio.ServicerContext):
        return pb.GetVoiceResponse(voice=voice_to_pb(await self.cache.get_voice(request.name)))

    async def ListVoices(self, request: pb.ListVoicesRequest, context: grpc.aio.ServicerContext):
        voices = await self.cache.list_voices()
        return pb.ListVoicesResponse(voices=[voice_to_pb(v.without_audio()) for v in voices])

    async def DeleteVoice(self, request: pb.DeleteVoiceRequest, context: grpc.aio.ServicerContext):
        await self.cache.delete_voice(request.name)
        return pb.DeleteVoiceResponse()
