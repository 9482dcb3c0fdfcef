"""What `/openapi.json` and `/docs` say about the speech endpoints beyond what FastAPI infers.

The speech handler parses its body itself (so that every error keeps OpenAI's shape), so the request
schema is attached from the typed models in `http_request`, and the responses (audio content types,
the error body, 429 with `Retry-After`) are declared here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from .audio_encoding import MEDIA_TYPES
from .http_request import SpeechRequest, StreamingSessionConfig


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, for a person to read.")
    type: str = Field(
        description="OpenAI's error type: invalid_request_error, not_found_error, rate_limit_error, ..."
    )
    param: str | None = Field(description="The request field at fault, when one is.")
    code: str | None = Field(
        description="A short machine-readable code (invalid_value, not_found, ...), or null."
    )


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


def _error(description: str, **extra: Any) -> dict:
    return {"model": ErrorResponse, "description": description, **extra}


_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds until the server expects a free slot.",
        "schema": {"type": "integer"},
    }
}
_AUDIO = {"schema": {"type": "string", "format": "binary"}}

SPEECH_RESPONSES: dict[int | str, dict] = {
    200: {
        "description": "The audio in `response_format` (streamed as it is produced unless `stream` is false), "
        "or server-sent events with `stream_format: sse`.",
        "content": {
            **{media: _AUDIO for media in dict.fromkeys(MEDIA_TYPES.values())},
            "text/event-stream": {"schema": {"type": "string"}},
        },
        "headers": {
            "x-request-id": {"description": "The request id.", "schema": {"type": "string"}},
            "x-tts-sample-rate": {"description": "Sample rate of the audio.", "schema": {"type": "integer"}},
            "x-tts-num-frames": {
                "description": "Generated codec frames (`stream: false` only).",
                "schema": {"type": "integer"},
            },
            "x-tts-finish-reason": {
                "description": "`stop` or `length` (`stream: false` only).",
                "schema": {"type": "string"},
            },
        },
    },
    400: _error("A field is invalid (`param` names it)."),
    404: _error("Unknown model, voice or speaker."),
    429: _error("No free synthesis slot; retry after `Retry-After` seconds.", headers=_RETRY_AFTER),
    500: _error("Generation failed."),
    503: _error("A stage the request needs is not serving."),
}

SPEECH_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SpeechRequest"}}},
    }
}

DESCRIPTION = (
    "OpenAI-compatible speech synthesis for Qwen3-TTS. `POST /v1/audio/speech` takes OpenAI's and "
    "vLLM-Omni's fields (schema `SpeechRequest`). The WebSocket `/v1/audio/speech/stream` takes text "
    "as it is produced: first a `session.config` message (schema `StreamingSessionConfig`), then "
    "`input.text`, `input.done`, `input.cancel` and `session.close`; see docs/api.md."
)


def install_openapi(app: FastAPI) -> None:
    """Generate the schema with the typed request models in its components (once, then cached)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (SpeechRequest, StreamingSessionConfig):
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
