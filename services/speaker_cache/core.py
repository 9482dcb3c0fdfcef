"""The speaker_cache core: validation and metrics around a `SpeakerStore` (no protobuf here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from qtts.request.errors import InvalidArgument
from qtts.serving.metrics import SpeakerCacheMetrics
from services.speaker_cache.records import (
    MAX_CONSENTS_PAGE,
    ConsentRecord,
    PromptRecord,
    VoiceRecord,
    validate_consent_id,
    validate_prompt_key,
    validate_voice_name,
)
from services.speaker_cache.store import SpeakerStore


class SpeakerCacheCore:
    """Voice prompts by content key and named voices, with hit/miss and voice-count metrics."""

    def __init__(
        self,
        store: SpeakerStore,
        metrics: SpeakerCacheMetrics,
        *,
        max_audio_bytes: int = 20 * 1024 * 1024,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.metrics = metrics
        self.max_audio_bytes = max_audio_bytes
        self._clock = clock

    async def refresh_voice_count(self) -> int:
        n = await self.store.count_voices()
        self.metrics.voices.set(n)
        return n

    async def get_prompt(self, key: str) -> PromptRecord | None:
        with self.metrics.stage_timer("get_prompt"):
            prompt = await self.store.get_prompt(validate_prompt_key(key))
        (self.metrics.misses_total if prompt is None else self.metrics.hits_total).inc()
        return prompt

    async def put_prompt(self, key: str, prompt: PromptRecord) -> None:
        with self.metrics.stage_timer("put_prompt"):
            await self.store.put_prompt(validate_prompt_key(key), prompt.validate())

    async def create_voice(self, voice: VoiceRecord, overwrite: bool = False) -> VoiceRecord:
        voice.validate(self.max_audio_bytes)
        if voice.created_unix_s <= 0:
            voice = replace(voice, created_unix_s=int(self._clock()))
        stored = await self.store.create_voice(voice, overwrite)
        await self.refresh_voice_count()
        return stored

    async def get_voice(self, name: str) -> VoiceRecord:
        with self.metrics.stage_timer("get_voice"):
            return await self.store.get_voice(validate_voice_name(name))

    async def list_voices(self) -> list[VoiceRecord]:
        return await self.store.list_voices()

    async def delete_voice(self, name: str) -> None:
        await self.store.delete_voice(validate_voice_name(name))
        await self.refresh_voice_count()

    async def put_consent(self, consent: ConsentRecord, create: bool) -> ConsentRecord:
        consent.validate()
        if consent.created_unix_s <= 0:
            consent = replace(consent, created_unix_s=int(self._clock()))
        return await self.store.put_consent(consent, create)

    async def get_consent(self, consent_id: str) -> ConsentRecord:
        return await self.store.get_consent(validate_consent_id(consent_id))

    async def list_consents(self, after: str, limit: int) -> tuple[list[ConsentRecord], bool]:
        if not 1 <= limit <= MAX_CONSENTS_PAGE:
            raise InvalidArgument(f"limit must be in 1..{MAX_CONSENTS_PAGE}", param="limit")
        return await self.store.list_consents(validate_consent_id(after) if after else "", limit)

    async def delete_consent(self, consent_id: str) -> None:
        await self.store.delete_consent(validate_consent_id(consent_id))
