"""The storage interface of speaker_cache; `lru_store` and `redis_store` implement it."""

from __future__ import annotations

from typing import Protocol

from services.speaker_cache.records import ConsentRecord, PromptRecord, VoiceRecord


class SpeakerStore(Protocol):
    """Async storage of voice prompts (a cache: may drop entries), named voices and voice
    consents (kept).

    `create_voice` raises `qtts.request.errors.AlreadyExists` unless `overwrite`; `get_voice` and
    `delete_voice` raise `qtts.request.errors.NotFound`; `put_consent` raises AlreadyExists (create, id
    taken), ResourceExhausted (create, at the bound) or NotFound (replace, absent); a store that
    cannot reach its backend raises `qtts.request.errors.Unavailable`.
    """

    async def ping(self) -> None: ...

    async def get_prompt(self, key: str) -> PromptRecord | None: ...

    async def put_prompt(self, key: str, prompt: PromptRecord) -> None: ...

    async def create_voice(self, voice: VoiceRecord, overwrite: bool) -> VoiceRecord: ...

    async def get_voice(self, name: str) -> VoiceRecord: ...

    async def list_voices(self) -> list[VoiceRecord]: ...

    async def delete_voice(self, name: str) -> None: ...

    async def count_voices(self) -> int: ...

    async def put_consent(self, consent: ConsentRecord, create: bool) -> ConsentRecord: ...

    async def get_consent(self, consent_id: str) -> ConsentRecord: ...

    async def list_consents(self, after: str, limit: int) -> tuple[list[ConsentRecord], bool]:
        """Up to `limit` records after the one with id `after` ("": from the first), oldest first,
        and whether more follow; InvalidArgument when `after` is unknown."""
        ...

    async def delete_consent(self, consent_id: str) -> None: ...

    async def close(self) -> None: ...
