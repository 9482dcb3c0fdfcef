"""What `/openapi.json` and `/docs` say about the speech endpoints beyond what FastAPI infers, and
the pages that show it: `/docs` (Swagger UI) and `/redoc` (ReDoc).

The speech handler parses its body itself (so that every error keeps OpenAI's shape), so the request
schema is attached from the typed models in `http_request`, and the responses (audio content types,
the error body, 429 with `Retry-After`) are declared here. The two pages load their scripts and
styles from the gateway itself (`/docs-assets/`, the files the fastapi-offline package ships), not
from a CDN: they work with no internet, as in many clusters.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
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
    },
    "retry-after-ms": {
        "description": "The same hint in milliseconds, drawn at random from 1 to 1.5 times it, so that "
        "clients that honour it (the OpenAI SDK reads it first) come back spread out.",
        "schema": {"type": "integer"},
    },
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


# Where the docs pages' own files are served (Swagger UI's bundle and CSS, ReDoc's standalone bundle).
DOCS_ASSETS = "/docs-assets"
REDOC_CSP = "img-src 'self' data: blob:"


def install_docs_pages(app: FastAPI) -> None:
    """GET /docs (Swagger UI) and /redoc (ReDoc), over assets served by the gateway. The app must be
    made with `docs_url=None, redoc_url=None` (FastAPI's own pages load them from a CDN)."""
    static = files("fastapi_offline") / "static"
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(static)), name="docs-assets")
    title = f"{app.title} - API"

    def urls(request: Request) -> tuple[str, str]:
        root = request.scope.get("root_path", "").rstrip("/")
        return root + (app.openapi_url or "/openapi.json"), root + DOCS_ASSETS

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        openapi_url, assets = urls(request)
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon.png",
            oauth2_redirect_url=None,
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        openapi_url, assets = urls(request)
        page = get_redoc_html(
            openapi_url=openapi_url,
            title=title,
            redoc_js_url=f"{assets}/redoc.standalone.js",
            redoc_favicon_url=f"{assets}/favicon.png",
            with_google_fonts=False,
        )
        # ReDoc's footer shows Redocly's logo from its CDN (hidden when it fails to load): images
        # come from the gateway only, so the page asks nothing of another host.
        page.headers["content-security-policy"] = REDOC_CSP
        return page
