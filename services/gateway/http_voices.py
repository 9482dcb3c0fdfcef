"""The voices API over HTTP: GET and POST /v1/audio/voices (list the named voices, upload one,
as multipart or JSON) and GET and DELETE /v1/audio/voices/{name}."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from qtts.request.errors import InvalidArgument

from .consents import ConsentStore
from .http_body import decode_base64_audio, json_body
from .voices import VoiceService

# Where a voice's clip may come: OpenAI's name first, then this API's older names.
_VOICE_AUDIO_FIELDS = ("audio_sample", "audio", "file", "ref_audio")


def _form_text(form, key: str) -> str | None:
    """A multipart text field; a file sent in its place is a 400 naming it."""
    value = form.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a text field, not a file", param=key)
    return value


def _check_voice_extras(kind: object, consent: object) -> None:
    """OpenAI's `type` (only "audio_sample" is served) and the type of `consent` (ConsentStore checks the id)."""
    if kind is not None and kind != "audio_sample":
        raise InvalidArgument(f"voice type {kind!r} is not supported; only 'audio_sample' is", param="type")
    if consent is not None and not isinstance(consent, str):
        raise InvalidArgument("consent must be a consent recording id (a string)", param="consent")


def add_voice_collection_routes(app: FastAPI, voices: VoiceService, consents: ConsentStore) -> None:
    """GET and POST /v1/audio/voices: list the named voices, upload one."""

    @app.get("/v1/audio/voices")
    async def list_voices() -> dict:
        return {"object": "list", "voices": [v.to_json() for v in await voices.list()]}

    @app.post("/v1/audio/voices", status_code=201)
    async def create_voice(request: Request) -> JSONResponse:
        """Multipart (`name`, `ref_text`, `x_vector_only_mode`, the clip as file `audio_sample`, OpenAI's
        name, or `audio`) or JSON with the clip in base64. OpenAI's `consent`, when given, must name a
        record of /v1/audio/voice_consents (consents.py); `type: "audio_sample"` is accepted. Without
        `ref_text` and without `x_vector_only_mode`, the voice is x-vector only."""
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            upload = await _multipart_voice(await request.form(), consents)
        else:
            upload = await _json_voice(await json_body(request), consents)
        voice = await voices.create(
            upload.name, upload.audio, upload.ref_text, upload.x_vector_only, audio_field=upload.audio_field
        )
        return JSONResponse(voice.to_json(), status_code=201)


@dataclass(frozen=True)
class _VoiceUpload:
    """The fields of a voice upload, checked, whichever body carried them."""

    name: str
    audio: bytes
    ref_text: str | None
    x_vector_only: bool | None
    audio_field: str  # where the clip came, for errors about it


async def _multipart_voice(form, consents: ConsentStore) -> _VoiceUpload:
    """A multipart voice upload: the clip as a file (or base64 text), the rest as text fields."""
    field = next((f for f in _VOICE_AUDIO_FIELDS if form.get(f) is not None), "audio_sample")
    upload = form.get(field)
    if upload is None:
        raise InvalidArgument(
            "multipart voice upload needs a file field 'audio_sample' (or 'audio')",
            param="audio_sample",
        )
    audio = await upload.read() if hasattr(upload, "read") else decode_base64_audio(str(upload), field)
    _check_voice_extras(_form_text(form, "type"), _form_text(form, "consent"))
    await consents.check(form.get("consent"))
    name, ref_text = _form_text(form, "name") or "", _form_text(form, "ref_text") or ""
    x_field = _form_text(form, "x_vector_only_mode")
    x_only = None if x_field is None else str(x_field).lower() in ("1", "true", "yes", "on")
    return _VoiceUpload(name, audio, ref_text, x_only, field)


async def _json_voice(body: object, consents: ConsentStore) -> _VoiceUpload:
    """A JSON voice upload: the clip as a base64 string or data URL."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    field = next((f for f in _VOICE_AUDIO_FIELDS if body.get(f) is not None), "audio_sample")
    b64 = body.get(field)
    if not isinstance(b64, str):
        raise InvalidArgument(f"{field} must be a base64 string or data URL", param=field)
    audio = decode_base64_audio(b64, field)
    _check_voice_extras(body.get("type"), body.get("consent"))
    await consents.check(body.get("consent"))
    name, ref_text = body.get("name"), body.get("ref_text")
    if not isinstance(name, str):
        raise InvalidArgument("name must be a string", param="name")
    if not isinstance(ref_text, str | None):
        raise InvalidArgument("ref_text must be a string", param="ref_text")
    x_only = body.get("x_vector_only_mode")
    if not isinstance(x_only, bool | None):
        raise InvalidArgument("x_vector_only_mode must be a boolean", param="x_vector_only_mode")
    return _VoiceUpload(name, audio, ref_text, x_only, field)


def add_voice_item_routes(app: FastAPI, voices: VoiceService) -> None:
    """GET and DELETE /v1/audio/voices/{name}: one named voice."""

    @app.get("/v1/audio/voices/{name}")
    async def get_voice(name: str) -> dict:
        return (await voices.get(name)).to_json()

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str) -> dict:
        """OpenAI's `VoiceDeleted` shape (plus `name`)."""
        await voices.delete(name)
        return {"id": name, "object": "audio.voice.deleted", "deleted": True, "name": name}
