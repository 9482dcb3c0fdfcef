"""The storage interface of speaker_cache; `lru_store` and `redis_store` implement it."""

from __future__ import annotations

from typing import Protocol

from services.speaker_cache.records import PromptRecord, VoiceRecord


class SpeakerStore(Protocol):
    """Async storage of voice prompts (a cache: may drop entries) and named voices (kept).

    `create_voice` raises `qtts.errors.AlreadyExists` unless `overwrite`; `get_voice` and
    `delete_voice` raise `qtts.errors.NotFound`; a store that cannot reach its backend raises
    `qtts.errors.Unavailable`.
    """

    async def ping(self) -> None: ...

    async def get_prompt(self, key: str) -> PromptRecord | None: ...

    async def put_prompt(self, key: str, prompt: PromptRecord) -> None: ...

    async def create_voice(self, voice: VoiceRecord, overwrite: bool) -> VoiceRecord: ...

    async def get_voice(self, name: str) -> VoiceRecord: ...

    async def list_voices(self) -> list[VoiceRecord]: ...

    async def delete_voice(self, name: str) -> None: ...

    async def count_voices(self) -> int: ...

    async def close(self) -> None: ...
