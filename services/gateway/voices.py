"""Named voices (create/list/delete), shared by the HTTP and the gRPC front ends."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np

from qtts.audio import check_wav_sizes
from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument

from .auth import current_owner, scoped_voice_name, unscoped_voice_name
from .job import ModelCatalog
from .validation import check_voice_name, named_field
from .voice_client import VoiceInfo


class VoiceStoreAPI(Protocol):
    async def list(self) -> list[VoiceInfo]: ...

    async def get(self, name: str) -> VoiceInfo: ...

    async def create(
        self, name: str, pcm_24k: np.ndarray, reference_text: str, x_vector_only: bool
    ) -> VoiceInfo: ...

    async def delete(self, name: str) -> None: ...


class VoiceService:
    """Validates voice requests, decodes reference clips and talks to the voice store."""

    def __init__(
        self,
        store: VoiceStoreAPI,
        decode: Callable[[bytes], np.ndarray],
        catalog: Callable[[], ModelCatalog | None],
        max_audio_bytes: int,
    ):
        self._store = store
        self._decode = decode
        self._catalog = catalog
        self._max_audio_bytes = max_audio_bytes

    async def list(self) -> list[VoiceInfo]:
        """Cloned voices from the store, then the model's preset speakers."""
        catalog = self._catalog()
        presets = [VoiceInfo(name=s, kind="preset") for s in (catalog.speakers if catalog else ())]
        owner = current_owner()
        own = [
            dataclasses.replace(v, name=name)
            for v in await self._store.list()
            if (name := unscoped_voice_name(v.name, owner)) is not None
        ]
        return [*sorted(own, key=lambda v: v.name), *presets]

    async def get(self, name: str) -> VoiceInfo:
        """A stored voice (with its clip's duration) or one of the model's preset speakers."""
        name = check_voice_name(name)
        catalog = self._catalog()
        if catalog and name.lower() in catalog.speakers:
            return VoiceInfo(name=name.lower(), kind="preset")
        voice = await self._store.get(scoped_voice_name(name, current_owner()))
        return dataclasses.replace(voice, name=name)

    async def create(
        self,
        name: str,
        audio: bytes | None,
        reference_text: str | None,
        x_vector_only: bool | None,
        audio_field: str = "audio",
    ) -> VoiceInfo:
        """Store a cloned voice; `audio_field` is the request field the clip came in (for errors).

        Without a transcript and without an explicit `x_vector_only`, the voice is x-vector only
        (cloned from the speaker embedding alone), as OpenAI's voice upload sends no transcript."""
        name = check_voice_name(name)
        lim.check_string(reference_text, "ref_text", lim.REF_TEXT_MAX_CHARS)
        if not audio:
            raise InvalidArgument(
                f"{audio_field} (the reference clip) is required to create a voice", param=audio_field
            )
        if len(audio) > self._max_audio_bytes:
            raise InvalidArgument(
                f"{audio_field} is {len(audio)} bytes; the limit is {self._max_audio_bytes}",
                param=audio_field,
            )
        ref_text = (reference_text or "").strip()
        if x_vector_only is None:
            x_vector_only = not ref_text
        if not x_vector_only and not ref_text:
            raise InvalidArgument(
                "ref_text (the transcript of the audio) is required unless x_vector_only_mode",
                param="ref_text",
            )
        try:
            check_wav_sizes(audio)  # stored for good: header and data must agree
            pcm = await asyncio.to_thread(self._decode, audio)
        except InvalidArgument as exc:
            raise named_field(exc, audio_field) from None
        stored = scoped_voice_name(name, current_owner())
        voice = await self._store.create(stored, pcm, "" if x_vector_only else ref_text, x_vector_only)
        return dataclasses.replace(voice, name=name)

    async def delete(self, name: str) -> None:
        await self._store.delete(scoped_voice_name(check_voice_name(name), current_owner()))
