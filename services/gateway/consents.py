"""OpenAI's voice consent recordings: `/v1/audio/voice_consents` create, list, get, rename, delete.

A consent record says who agreed to have their voice cloned (`name`), in which language the consent
phrase was spoken and when; `POST /v1/audio/voices` (and gRPC CreateVoice) with a `consent` id
checks it against these. The records live in speaker_cache (its in-process store, or Redis), so
every gateway replica knows every consent and they survive a gateway restart; the recording's
sha256 and size are kept, not the audio. `MemoryConsents` keeps them in this process instead (a
gateway on its own, tests).

With API keys on, a record belongs to the key that created it, as a voice does: its id carries the
key's owner id (`cons_<owner>_<random>`), and a key lists, reads, renames, deletes and cites in a
voice upload only its own records; another key's id is answered as one that does not exist.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Protocol

from fastapi import APIRouter, Request

from qtts.request.errors import InvalidArgument, NotFound, ResourceExhausted

from .auth import current_owner

# OpenAI's limit on a consent recording.
MAX_RECORDING_BYTES = 10 * 1024 * 1024
MAX_NAME_CHARS = 256
MAX_LANGUAGE_CHARS = 35  # a BCP 47 tag such as "en-US"
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 20, 100


@dataclass(frozen=True)
class VoiceConsent:
    """One consent recording's record (OpenAI's `audio.voice_consent`, plus what was uploaded)."""

    id: str
    name: str
    language: str
    created_at: int
    recording_sha256: str
    recording_bytes: int

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "object": "audio.voice_consent",
            "name": self.name,
            "language": self.language,
            "created_at": self.created_at,
        }


def _text(value: object, field: str, limit: int) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{field} is required (a non-empty string)", param=field)
    if len(value) > limit:
        raise InvalidArgument(f"{field} is longer than {limit} characters", param=field)
    return value.strip()


class ConsentBackend(Protocol):
    """Where the records live. `put` creates (AlreadyExists, ResourceExhausted at the bound) or
    replaces (NotFound when absent); `get` and `delete` raise NotFound; `page` lists oldest first
    and raises InvalidArgument for an unknown `after`."""

    async def put(self, consent: VoiceConsent, create: bool) -> VoiceConsent: ...

    async def get(self, consent_id: str) -> VoiceConsent: ...

    async def page(self, after: str, limit: int) -> tuple[list[VoiceConsent], bool]: ...

    async def delete(self, consent_id: str) -> None: ...


class MemoryConsents:
    """`ConsentBackend` in this process: creation order, at most `max_records`."""

    def __init__(self, max_records: int = 10_000):
        self._records: OrderedDict[str, VoiceConsent] = OrderedDict()
        self._max = max_records

    async def put(self, consent: VoiceConsent, create: bool) -> VoiceConsent:
        known = consent.id in self._records
        if create and len(self._records) >= self._max:
            raise ResourceExhausted(f"this gateway holds {self._max} consent records; delete some first")
        if not create and not known:
            raise NotFound(f"no voice consent {consent.id!r}")
        self._records[consent.id] = consent
        return consent

    async def get(self, consent_id: str) -> VoiceConsent:
        consent = self._records.get(consent_id)
        if consent is None:
            raise NotFound(f"no voice consent {consent_id!r}")
        return consent

    async def page(self, after: str, limit: int) -> tuple[list[VoiceConsent], bool]:
        ids = list(self._records)
        start = 0
        if after:
            if after not in self._records:
                raise InvalidArgument(f"after: no voice consent {after!r}", param="after")
            start = ids.index(after) + 1
        return [self._records[i] for i in ids[start : start + limit]], start + limit < len(ids)

    async def delete(self, consent_id: str) -> None:
        if self._records.pop(consent_id, None) is None:
            raise NotFound(f"no voice consent {consent_id!r}")


def _id_prefix(owner: str) -> str:
    """The start of every id of `owner`'s records ("cons_" when API keys are off)."""
    return f"cons_{owner}_" if owner else "cons_"


def _owned(consent_id: str) -> bool:
    """Whether the caller may see the record `consent_id` (any record when API keys are off)."""
    owner = current_owner()
    return not owner or consent_id.startswith(_id_prefix(owner))


class ConsentStore:
    """The consent records' rules (fields, limits, ids, owners) over a `ConsentBackend`."""

    def __init__(self, backend: ConsentBackend | None = None, max_records: int = 10_000):
        self._backend = backend if backend is not None else MemoryConsents(max_records)

    async def create(self, name: object, language: object, recording: bytes) -> VoiceConsent:
        name = _text(name, "name", MAX_NAME_CHARS)
        language = _text(language, "language", MAX_LANGUAGE_CHARS)
        if not recording:
            raise InvalidArgument("recording (the consent audio file) is required", param="recording")
        if len(recording) > MAX_RECORDING_BYTES:
            raise InvalidArgument(f"recording is over {MAX_RECORDING_BYTES} bytes", param="recording")
        consent = VoiceConsent(
            _id_prefix(current_owner()) + secrets.token_hex(12),
            name,
            language,
            int(time.time()),
            hashlib.sha256(recording).hexdigest(),
            len(recording),
        )
        return await self._backend.put(consent, create=True)

    async def get(self, consent_id: str) -> VoiceConsent:
        try:
            return await self._own(consent_id)
        except NotFound as exc:
            exc.param = "consent_id"
            raise

    async def rename(self, consent_id: str, name: object) -> VoiceConsent:
        name = _text(name, "name", MAX_NAME_CHARS)
        return await self._backend.put(replace(await self.get(consent_id), name=name), create=False)

    async def delete(self, consent_id: str) -> None:
        try:
            await self._own(consent_id)
            await self._backend.delete(consent_id)
        except NotFound as exc:
            exc.param = "consent_id"
            raise

    async def page(self, after: str | None, limit: int) -> tuple[list[VoiceConsent], bool]:
        """Up to `limit` of the caller's records after the one with id `after` (OpenAI's cursor),
        and whether more follow."""
        if not current_owner():
            return await self._backend.page(after or "", limit)
        if after and not _owned(after):
            raise InvalidArgument(f"after: no voice consent {after!r}", param="after")
        out: list[VoiceConsent] = []
        cursor = after or ""
        while True:  # the backend pages over every key's records: keep the caller's
            records, more = await self._backend.page(cursor, LIST_LIMIT_MAX)
            for consent in records:
                if _owned(consent.id):
                    if len(out) == limit:
                        return out, True
                    out.append(consent)
            if not more or not records:
                return out, False
            cursor = records[-1].id

    async def check(self, consent: object) -> None:
        """A voice upload's `consent`: absent, or the id of one of the caller's records."""
        if consent is None or consent == "":
            return
        if not isinstance(consent, str):
            raise InvalidArgument("consent must be a consent recording id (a string)", param="consent")
        try:
            await self._own(consent)
        except (NotFound, InvalidArgument):
            raise NotFound(
                f"consent {consent!r} is not a voice consent of this server "
                "(create one with POST /v1/audio/voice_consents)",
                param="consent",
            ) from None

    async def _own(self, consent_id: str) -> VoiceConsent:
        """The caller's record `consent_id`; another key's is NotFound, as an absent one."""
        if not _owned(consent_id):
            raise NotFound(f"no voice consent {consent_id!r}")
        return await self._backend.get(consent_id)


def _limit(raw: str | None) -> int:
    if raw is None:
        return LIST_LIMIT_DEFAULT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise InvalidArgument(f"limit must be an integer in 1..{LIST_LIMIT_MAX}", param="limit")
    return limit


def consent_router(store: ConsentStore) -> APIRouter:
    """The routes, as OpenAI's SDK calls them (`client.audio.voice_consents.*`)."""
    router = APIRouter()

    @router.post("/v1/audio/voice_consents")
    async def create_consent(request: Request) -> dict:
        """Multipart `name`, `language` (BCP 47) and the file `recording` (at most 10 MiB)."""
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise InvalidArgument("a voice consent is uploaded as multipart/form-data", param="recording")
        form = await request.form()
        upload = form.get("recording")
        recording = await upload.read(MAX_RECORDING_BYTES + 1) if hasattr(upload, "read") else b""
        return (await store.create(form.get("name"), form.get("language"), recording)).to_json()

    @router.get("/v1/audio/voice_consents")
    async def list_consents(after: str | None = None, limit: str | None = None) -> dict:
        records, more = await store.page(after, _limit(limit))
        return {
            "object": "list",
            "data": [c.to_json() for c in records],
            "has_more": more,
            "first_id": records[0].id if records else None,
            "last_id": records[-1].id if records else None,
        }

    @router.get("/v1/audio/voice_consents/{consent_id}")
    async def get_consent(consent_id: str) -> dict:
        return (await store.get(consent_id)).to_json()

    @router.post("/v1/audio/voice_consents/{consent_id}")
    async def rename_consent(consent_id: str, request: Request) -> dict:
        """OpenAI's update: JSON `{"name": ...}`."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object with name", param="name")
        return (await store.rename(consent_id, body.get("name"))).to_json()

    @router.delete("/v1/audio/voice_consents/{consent_id}")
    async def delete_consent(consent_id: str) -> dict:
        await store.delete(consent_id)
        return {"id": consent_id, "object": "audio.voice_consent", "deleted": True}

    return router
