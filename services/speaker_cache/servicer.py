"""`speaker_cache.v1.SpeakerCacheService`: converts protobuf to records and calls `SpeakerCacheCore`."""

from __future__ import annotations

import dataclasses

import grpc

from qtts.pb import speaker_cache_pb2 as pb
from qtts.pb import speaker_cache_pb2_grpc
from services.speaker_cache.core import SpeakerCacheCore
from services.speaker_cache.records import ConsentRecord, PromptRecord, VoiceRecord


def _fields(record_type: type, source: object) -> dict:
    """The record's fields read off a message or record with the same field names."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(record_type)}


def prompt_from_pb(p: pb.VoicePrompt) -> PromptRecord:
    return PromptRecord(**_fields(PromptRecord, p))


def prompt_to_pb(r: PromptRecord) -> pb.VoicePrompt:
    return pb.VoicePrompt(**_fields(PromptRecord, r))


def voice_from_pb(v: pb.StoredVoice) -> VoiceRecord:
    return VoiceRecord(**_fields(VoiceRecord, v))


def voice_to_pb(r: VoiceRecord) -> pb.StoredVoice:
    return pb.StoredVoice(**_fields(VoiceRecord, r))


def consent_from_pb(c: pb.VoiceConsent) -> ConsentRecord:
    return ConsentRecord(**_fields(ConsentRecord, c))


def consent_to_pb(r: ConsentRecord) -> pb.VoiceConsent:
    return pb.VoiceConsent(**_fields(ConsentRecord, r))


class SpeakerCacheServicer(speaker_cache_pb2_grpc.SpeakerCacheServiceServicer):
    """Thin gRPC adapter; domain errors become status codes in the server's interceptor."""

    def __init__(self, cache: SpeakerCacheCore):
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

    async def PutConsent(self, request: pb.PutConsentRequest, context: grpc.aio.ServicerContext):
        consent = await self.cache.put_consent(consent_from_pb(request.consent), create=request.create)
        return pb.PutConsentResponse(consent=consent_to_pb(consent))

    async def GetConsent(self, request: pb.GetConsentRequest, context: grpc.aio.ServicerContext):
        return pb.GetConsentResponse(consent=consent_to_pb(await self.cache.get_consent(request.id)))

    async def ListConsents(self, request: pb.ListConsentsRequest, context: grpc.aio.ServicerContext):
        consents, more = await self.cache.list_consents(request.after, request.limit)
        return pb.ListConsentsResponse(consents=[consent_to_pb(c) for c in consents], has_more=more)

    async def DeleteConsent(self, request: pb.DeleteConsentRequest, context: grpc.aio.ServicerContext):
        await self.cache.delete_consent(request.id)
        return pb.DeleteConsentResponse()
