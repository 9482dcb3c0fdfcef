"""OpenAI's voice consent recordings: `/v1/audio/voice_consents` create, list, get, rename, delete.

A consent record says who agreed to have their voice cloned (`name`), in which language the consent
phrase was spoken and when; `POST /v1/audio/voices` with a `consent` id checks it against these.
The records live in this gateway process (bounded; the recording's sha256 and size are kept, not the
audio): the speaker_cache protocol has no place for them yet, so with several gateway replicas or
after a restart a consent id is only known where it was created.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request

from qtts.errors import InvalidArgument, NotFound, ResourceExhausted

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


class ConsentStore:
    """Consent records in creation order, at most `max_records` (then creating is a 429)."""

    def __init__(self, max_records: int = 10_000):
        self._records: OrderedDict[str, VoiceConsent] = OrderedDict()
        self._max = max_records

    def create(self, name: object, language: object, recording: bytes) -> VoiceConsent:
        name = _text(name, "name", MAX_NAME_CHARS)
        language = _text(language, "language", MAX_LANGUAGE_CHARS)
        if not recording:
            raise InvalidArgument("recording (the consent audio file) is required", param="recording")
        if len(recording) > MAX_RECORDING_BYTES:
            raise InvalidArgument(f"recording is over {MAX_RECORDING_BYTES} bytes", param="recording")
        if len(self._records) >= self._max:
            raise ResourceExhausted(f"this gateway holds {self._max} consent records; delete some first")
        consent = VoiceConsent(
            f"cons_{secrets.token_hex(12)}",
            name,
            language,
            int(time.time()),
            hashlib.sha256(recording).hexdigest(),
            len(recording),
        )
        self._records[consent.id] = consent
        return consent

    def get(self, consent_id: str) -> VoiceConsent:
        consent = self._records.get(consent_id)
        if consent is None:
            raise NotFound(f"no voice consent {consent_id!r}", param="consent_id")
        return consent

    def rename(self, consent_id: str, name: object) -> VoiceConsent:
        consent = replace(self.get(consent_id), name=_text(name, "name", MAX_NAME_CHARS))
        self._records[consent_id] = consent
        return consent

    def delete(self, consent_id: str) -> None:
        self.get(consent_id)
        del self._records[consent_id]

    def page(self, after: str | None, limit: int) -> tuple[list[VoiceConsent], bool]:
        """Up to `limit` records after the one with id `after` (OpenAI's cursor), and whether more follow."""
        ids = list(self._records)
        start = 0
        if after:
            if after not in self._records:
                raise InvalidArgument(f"after: no voice consent {after!r}", param="after")
            start = ids.index(after) + 1
        chosen = ids[start : start + limit]
        return [self._records[i] for i in chosen], start + limit < len(ids)

    def check(self, consent: object) -> None:
        """A voice upload's `consent`: absent, or the id of a record here."""
        if consent is None or consent == "":
            return
        if not isinstance(consent, str):
            raise InvalidArgument("consent must be a consent recording id (a string)", param="consent")
        if consent not in self._records:
            raise NotFound(
                f"consent {consent!r} is not a voice consent of this server "
                "(create one with POST /v1/audio/voice_consents)",
                param="consent",
            )


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
        return store.create(form.get("name"), form.get("language"), recording).to_json()

    @router.get("/v1/audio/voice_consents")
    async def list_consents(after: str | None = None, limit: str | None = None) -> dict:
        records, more = store.page(after, _limit(limit))
        return {
            "object": "list",
            "data": [c.to_json() for c in records],
            "has_more": more,
            "first_id": records[0].id if records else None,
            "last_id": records[-1].id if records else None,
        }

    @router.get("/v1/audio/voice_consents/{consent_id}")
    async def get_consent(consent_id: str) -> dict:
        return store.get(consent_id).to_json()

    @router.post("/v1/audio/voice_consents/{consent_id}")
    async def rename_consent(consent_id: str, request: Request) -> dict:
        """OpenAI's update: JSON `{"name": ...}`."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object with name", param="name")
        return store.rename(consent_id, body.get("name")).to_json()

    @router.delete("/v1/audio/voice_consents/{consent_id}")
    async def delete_consent(consent_id: str) -> dict:
        store.delete(consent_id)
        return {"id": consent_id, "object": "audio.voice_consent", "deleted": True}

    return router
