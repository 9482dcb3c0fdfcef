"""gRPC client of speaker_cache's named-voice and voice-consent API, in gateway terms."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import numpy as np

from qtts.pb import speaker_cache_pb2, speaker_cache_pb2_grpc
from qtts.request.errors import TTSError, Unavailable, from_grpc
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE
from qtts.serving.grpc_server import RECONNECT_OPTIONS
from qtts.serving.internal_auth import client_interceptors
from qtts.serving.log_context import outgoing_metadata
from qtts.serving.tls import TlsConfig, aio_channel

from .consents import VoiceConsent


@dataclass(frozen=True)
class VoiceInfo:
    """A named voice as listed to clients (no audio)."""

    name: str
    kind: str  # "cloned" or "preset"
    reference_text: str = ""
    x_vector_only: bool = False
    reference_duration_s: float = 0.0
    created_unix_s: int = 0

    def to_json(self) -> dict:
        """OpenAI's voice object (`id`, `object`, `type`, `name`, `created_at`) plus this API's fields."""
        return {
            "id": self.name,
            "object": "audio.voice",
            "type": "audio_sample" if self.kind == "cloned" else self.kind,
            "name": self.name,
            "kind": self.kind,
            "ref_text": self.reference_text,
            "x_vector_only_mode": self.x_vector_only,
            "duration_s": round(self.reference_duration_s, 3),
            "created_at": self.created_unix_s,
        }


def _voice_info(v: speaker_cache_pb2.StoredVoice) -> VoiceInfo:
    rate = v.sample_rate_hz or NATIVE_SAMPLE_RATE
    return VoiceInfo(
        name=v.name,
        kind="cloned",
        reference_text=v.reference_text,
        x_vector_only=v.x_vector_only,
        reference_duration_s=(len(v.reference_pcm_f32) // 4 or v.num_samples) / rate,
        created_unix_s=v.created_unix_s,
    )


def _error(exc: grpc.aio.AioRpcError, address: str) -> TTSError:
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"speaker_cache at {address}: {exc.details() or exc.code().name}")
    return from_grpc(exc.code(), exc.details())


class VoiceClient:
    """Create, list and delete named voices stored by speaker_cache."""

    def __init__(self, address: str, token: str = "", tls: TlsConfig | None = None):
        self.address = address
        self._channel = aio_channel(
            address, tls, options=RECONNECT_OPTIONS, interceptors=client_interceptors(token)
        )
        self._stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(self._channel)

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._channel

    async def list(self, timeout: float = 10.0) -> list[VoiceInfo]:
        try:
            resp = await self._stub.ListVoices(
                speaker_cache_pb2.ListVoicesRequest(), timeout=timeout, metadata=outgoing_metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from None
        return [_voice_info(v) for v in resp.voices]

    async def get(self, name: str, timeout: float = 10.0) -> VoiceInfo:
        """One voice, with the duration of its stored clip."""
        try:
            resp = await self._stub.GetVoice(
                speaker_cache_pb2.GetVoiceRequest(name=name), timeout=timeout, metadata=outgoing_metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from None
        return _voice_info(resp.voice)

    async def create(
        self, name: str, pcm_24k: np.ndarray, reference_text: str, x_vector_only: bool, timeout: float = 10.0
    ) -> VoiceInfo:
        voice = speaker_cache_pb2.StoredVoice(
            name=name,
            reference_pcm_f32=np.ascontiguousarray(pcm_24k, dtype="<f4").tobytes(),
            sample_rate_hz=NATIVE_SAMPLE_RATE,
            reference_text=reference_text,
            x_vector_only=x_vector_only,
            created_unix_s=int(time.time()),
        )
        try:
            resp = await self._stub.CreateVoice(
                speaker_cache_pb2.CreateVoiceRequest(voice=voice),
                timeout=timeout,
                metadata=outgoing_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from None
        stored = resp.voice if resp.HasField("voice") else voice
        if not stored.reference_pcm_f32:
            stored = voice
        return _voice_info(stored)

    async def delete(self, name: str, timeout: float = 10.0) -> None:
        try:
            await self._stub.DeleteVoice(
                speaker_cache_pb2.DeleteVoiceRequest(name=name), timeout=timeout, metadata=outgoing_metadata()
            )
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from None

    async def call(self, method: str, request, timeout: float = 10.0):
        """One unary call of the stub; gRPC errors as domain errors."""
        try:
            return await getattr(self._stub, method)(request, timeout=timeout, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, self.address) from None

    async def close(self) -> None:
        await self._channel.close()


def _consent_pb(c: VoiceConsent) -> speaker_cache_pb2.VoiceConsent:
    return speaker_cache_pb2.VoiceConsent(
        id=c.id,
        name=c.name,
        language=c.language,
        created_unix_s=c.created_at,
        recording_sha256=c.recording_sha256,
        recording_bytes=c.recording_bytes,
    )


def _consent(c: speaker_cache_pb2.VoiceConsent) -> VoiceConsent:
    return VoiceConsent(c.id, c.name, c.language, c.created_unix_s, c.recording_sha256, c.recording_bytes)


class SpeakerCacheConsents:
    """`consents.ConsentBackend` in speaker_cache: every gateway replica sees the same records."""

    def __init__(self, client: VoiceClient):
        self._client = client

    async def put(self, consent: VoiceConsent, create: bool) -> VoiceConsent:
        req = speaker_cache_pb2.PutConsentRequest(consent=_consent_pb(consent), create=create)
        return _consent((await self._client.call("PutConsent", req)).consent)

    async def get(self, consent_id: str) -> VoiceConsent:
        req = speaker_cache_pb2.GetConsentRequest(id=consent_id)
        return _consent((await self._client.call("GetConsent", req)).consent)

    async def page(self, after: str, limit: int) -> tuple[list[VoiceConsent], bool]:
        resp = await self._client.call(
            "ListConsents", speaker_cache_pb2.ListConsentsRequest(after=after, limit=limit)
        )
        return [_consent(c) for c in resp.consents], resp.has_more

    async def delete(self, consent_id: str) -> None:
        await self._client.call("DeleteConsent", speaker_cache_pb2.DeleteConsentRequest(id=consent_id))
