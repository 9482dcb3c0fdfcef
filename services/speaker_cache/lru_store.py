"""In-process store: voice prompts in an LRU bounded by entries and bytes, voices in a dict.

The embedded default for a single-machine run; nothing survives a restart of the process.
"""

from __future__ import annotations

from collections import OrderedDict

from qtts.lru import BoundedLru
from qtts.request.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from services.speaker_cache.records import ConsentRecord, PromptRecord, VoiceRecord


def _nbytes(prompt: PromptRecord) -> int:
    return prompt.nbytes


class LruStore:
    """`SpeakerStore` in memory. Prompts are evicted least-recently-used first."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 512 * 1024 * 1024, max_voices: int = 10_000):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be >= 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_voices = max_voices
        self._prompts: BoundedLru[str, PromptRecord] = BoundedLru(max_entries, max_bytes, _nbytes)
        self._voices: dict[str, VoiceRecord] = {}
        self._consents: OrderedDict[str, ConsentRecord] = OrderedDict()  # in creation order

    @property
    def num_prompts(self) -> int:
        return len(self._prompts)

    @property
    def prompt_bytes(self) -> int:
        return self._prompts.cost_used

    async def ping(self) -> None:
        return None

    async def get_prompt(self, key: str) -> PromptRecord | None:
        return self._prompts.get(key)

    async def put_prompt(self, key: str, prompt: PromptRecord) -> None:
        # One larger than the whole cache is not cached, like any evicted entry.
        self._prompts.put(key, prompt)

    async def create_voice(self, voice: VoiceRecord, overwrite: bool) -> VoiceRecord:
        if voice.name in self._voices and not overwrite:
            raise AlreadyExists(f"voice {voice.name!r} already exists")
        if voice.name not in self._voices and len(self._voices) >= self.max_voices:
            raise ResourceExhausted(f"voice limit reached ({self.max_voices})")
        self._voices[voice.name] = voice
        return voice

    async def get_voice(self, name: str) -> VoiceRecord:
        try:
            return self._voices[name]
        except KeyError:
            raise NotFound(f"voice {name!r} not found") from None

    async def list_voices(self) -> list[VoiceRecord]:
        return [v.without_audio() for _, v in sorted(self._voices.items())]

    async def delete_voice(self, name: str) -> None:
        if self._voices.pop(name, None) is None:
            raise NotFound(f"voice {name!r} not found")

    async def count_voices(self) -> int:
        return len(self._voices)

    async def put_consent(self, consent: ConsentRecord, create: bool) -> ConsentRecord:
        known = consent.id in self._consents
        if create and known:
            raise AlreadyExists(f"consent {consent.id!r} already exists")
        if create and len(self._consents) >= self.max_voices:
            raise ResourceExhausted(f"consent limit reached ({self.max_voices})")
        if not create and not known:
            raise NotFound(f"no voice consent {consent.id!r}")
        self._consents[consent.id] = consent
        return consent

    async def get_consent(self, consent_id: str) -> ConsentRecord:
        try:
            return self._consents[consent_id]
        except KeyError:
            raise NotFound(f"no voice consent {consent_id!r}") from None

    async def list_consents(self, after: str, limit: int) -> tuple[list[ConsentRecord], bool]:
        ids = list(self._consents)
        start = 0
        if after:
            if after not in self._consents:
                raise InvalidArgument(f"after: no voice consent {after!r}", param="after")
            start = ids.index(after) + 1
        return [self._consents[i] for i in ids[start : start + limit]], start + limit < len(ids)

    async def delete_consent(self, consent_id: str) -> None:
        if self._consents.pop(consent_id, None) is None:
            raise NotFound(f"no voice consent {consent_id!r}")

    async def close(self) -> None:
        return None
