"""speaker_cache client for the talker: named voices and voice prompts by content key.

The only talker module that touches the speaker_cache protobufs; it returns plain numpy records.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from qtts.pb import speaker_cache_pb2, speaker_cache_pb2_grpc
from qtts.request.errors import NotFound, Unavailable, from_grpc
from qtts.serving.grpc_server import RECONNECT_OPTIONS
from qtts.serving.internal_auth import client_interceptors
from qtts.serving.log_context import outgoing_metadata
from qtts.serving.tls import TlsConfig, aio_channel


class SpeakerCacheUnreachable(Unavailable):
    """speaker_cache did not answer (not configured, down, or too slow)."""


@dataclass(frozen=True)
class StoredVoiceRecord:
    """A named voice: its reference clip as float32 mono PCM."""

    name: str
    pcm_f32: np.ndarray
    sample_rate_hz: int
    reference_text: str
    x_vector_only: bool


@dataclass(frozen=True)
class VoicePromptArrays:
    """A computed voice prompt in transport form (numpy, no torch)."""

    model_id: str
    x_vector: np.ndarray  # float32 [H]
    ref_codes: np.ndarray | None  # int16 [T, num_codebooks]
    reference_text: str | None
    x_vector_only: bool


class SpeakerCacheClient:
    """Calls speaker_cache with a per-call timeout; `address=None` means no speaker_cache."""

    def __init__(
        self, address: str | None, timeout_s: float = 2.0, token: str = "", tls: TlsConfig | None = None
    ):
        self.address = address
        self._timeout_s = timeout_s
        self._channel = (
            aio_channel(
                address,
                tls,
                options=[
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024),
                    *RECONNECT_OPTIONS,
                ],
                interceptors=client_interceptors(token),
            )
            if address
            else None
        )
        self._stub = speaker_cache_pb2_grpc.SpeakerCacheServiceStub(self._channel) if self._channel else None

    def _require(self) -> speaker_cache_pb2_grpc.SpeakerCacheServiceStub:
        if self._stub is None:
            raise SpeakerCacheUnreachable("no speaker_cache is configured")
        return self._stub

    def _unreachable(self, exc: grpc.aio.AioRpcError) -> Exception:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return SpeakerCacheUnreachable(f"speaker_cache at {self.address} is unreachable: {exc.details()}")
        return from_grpc(exc.code(), f"speaker_cache: {exc.details()}")

    async def get_voice(self, name: str) -> StoredVoiceRecord:
        """The named voice; NotFound when there is none, SpeakerCacheUnreachable when no answer."""
        try:
            resp = await self._require().GetVoice(
                speaker_cache_pb2.GetVoiceRequest(name=name),
                timeout=self._timeout_s,
                metadata=outgoing_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"voice {name!r} not found") from None
            raise self._unreachable(exc) from None
        v = resp.voice
        return StoredVoiceRecord(
            name=v.name,
            pcm_f32=np.frombuffer(v.reference_pcm_f32, dtype="<f4").copy(),
            sample_rate_hz=v.sample_rate_hz or 24000,
            reference_text=v.reference_text,
            x_vector_only=v.x_vector_only,
        )

    async def get_prompt(self, key: str) -> VoicePromptArrays | None:
        try:
            resp = await self._require().GetVoicePrompt(
                speaker_cache_pb2.GetVoicePromptRequest(key=key),
                timeout=self._timeout_s,
                metadata=outgoing_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            raise self._unreachable(exc) from None
        if not resp.found:
            return None
        p = resp.prompt
        codes = None
        if p.num_reference_frames:
            codes = (
                np.frombuffer(p.reference_codes_i16, dtype="<i2")
                .reshape(p.num_reference_frames, p.num_codebooks)
                .copy()
            )
        return VoicePromptArrays(
            model_id=p.model_id,
            x_vector=np.frombuffer(p.x_vector_f32, dtype="<f4").copy(),
            ref_codes=codes,
            reference_text=p.reference_text or None,
            x_vector_only=p.x_vector_only,
        )

    async def put_prompt(self, key: str, record: VoicePromptArrays) -> None:
        prompt = speaker_cache_pb2.VoicePrompt(
            model_id=record.model_id,
            x_vector_f32=np.ascontiguousarray(record.x_vector, dtype="<f4").tobytes(),
            x_vector_dim=int(record.x_vector.shape[0]),
            reference_text=record.reference_text or "",
            x_vector_only=record.x_vector_only,
        )
        if record.ref_codes is not None:
            prompt.reference_codes_i16 = np.ascontiguousarray(record.ref_codes, dtype="<i2").tobytes()
            prompt.num_reference_frames = int(record.ref_codes.shape[0])
            prompt.num_codebooks = int(record.ref_codes.shape[1])
        try:
            await self._require().PutVoicePrompt(
                speaker_cache_pb2.PutVoicePromptRequest(key=key, prompt=prompt),
                timeout=self._timeout_s,
                metadata=outgoing_metadata(),
            )
        except grpc.aio.AioRpcError as exc:
            raise self._unreachable(exc) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
