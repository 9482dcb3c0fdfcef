"""The OpenAI-compatible HTTP API: /v1/audio/speech, /v1/models, /v1/audio/voices, /health."""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from qtts.request.errors import (
    InvalidArgument,
    NotFound,
    TTSError,
    mapping_for,
    openai_error_body,
    retry_headers,
)
from qtts.serving.metrics import GatewayMetrics

from . import sse
from .aligner_client import AlignerClient, check_alignable
from .audio_encoding import MEDIA_TYPES, check_output_format
from .audio_output import AudioOutput
from .auth import ApiKeyMiddleware, ApiKeys
from .batch import batch_router
from .client_identity import ClientIdentityMiddleware
from .consents import ConsentStore, consent_router
from .core import GatewayCore, SynthesisStream
from .http_body import json_body
from .http_limits import BodyLimitMiddleware
from .http_refusal import SPEECH_PATH, EarlyRefusalMiddleware
from .http_request import OutputOptions, parse_speech_body
from .http_streaming import (
    DisconnectAwareStreamingResponse,
    install_abort_log_filter,
    run_unless_disconnected,
)
from .http_voices import add_voice_collection_routes, add_voice_item_routes
from .instructions import ignored_fields_header
from .job import SynthesisJob
from .openapi_docs import SPEECH_OPENAPI, SPEECH_RESPONSES, install_docs_pages, install_openapi
from .playback import PlaybackClock
from .rate_limit import RateLimiter, RateLimitMiddleware
from .speech_ws import SpeechStreamEndpoint
from .status import StatusReporter
from .voices import VoiceService

log = logging.getLogger(__name__)

# The stages synthesis cannot do without; the others (speaker_cache) only degrade the service.
REQUIRED_STAGES = ("talker",)

# The playground page (GET /): static HTML, CSS and JavaScript shipped with the gateway.
STATIC_DIR = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True)
class HttpDeps:
    """What the HTTP app needs, built by the server and injected."""

    synthesizer: GatewayCore
    voices: VoiceService
    metrics: GatewayMetrics
    # Status name per stage the gateway needs ("SERVING", ...).
    stage_health: Callable[[], Awaitable[dict[str, str]]]
    # GET /v1/status; None: gateway figures only (no talker metrics).
    status: StatusReporter | None = None
    # /v1/audio/voice_consents, and what a voice upload's `consent` is checked against.
    consents: ConsentStore = field(default_factory=ConsentStore)
    # What one client may hold (services/gateway/http_limits.py); 0 = no limit.
    max_body_bytes: int = 0
    body_timeout_s: float = 0.0
    # The whole body within this long of the request's start (0 = no such bound).
    body_deadline_s: float = 0.0
    write_timeout_s: float = 0.0
    # The largest WebSocket message (uvicorn's ws_max_size is the same); 0: speech_ws's default.
    ws_max_message_bytes: int = 0
    # A WebSocket session silent this long while nothing is synthesised is closed (0 = never).
    stream_idle_timeout_s: float = 30.0
    # None or no keys: no authentication.
    api_keys: ApiKeys | None = None
    # Requests per client and second (rate_limit.py); None: no such limit.
    rate_limiter: RateLimiter | None = None
    # The aligner stage (--aligner); None: word_timestamps is refused.
    aligner: AlignerClient | None = None


def error_response(exc: BaseException, metrics: GatewayMetrics | None = None) -> JSONResponse:
    """The OpenAI-shaped JSON error with the mapped HTTP status."""
    m = mapping_for(exc)
    if metrics is not None:
        metrics.error(m.grpc_code.name)
    if not isinstance(exc, TTSError):
        log.error("unexpected error", exc_info=exc)
    retry_after = getattr(exc, "retry_after_s", None)
    headers = retry_headers(retry_after) if retry_after else None
    return JSONResponse(openai_error_body(exc), status_code=m.http_status, headers=headers)


def _result_headers(stream: SynthesisStream, sample_rate: int) -> dict[str, str]:
    headers = {
        "x-request-id": stream.job.request_id,
        "x-tts-sample-rate": str(sample_rate),
        **ignored_fields_header(stream.job),
    }
    s = stream.summary
    if s is not None:
        headers.update(
            {
                "x-tts-num-frames": str(s.num_frames),
                "x-tts-finish-reason": s.finish_reason,
                "x-tts-code2wav-replica": s.code2wav_replica,
            }
        )
    return headers


def _check_word_timestamps(deps: HttpDeps, job: SynthesisJob) -> None:
    if deps.aligner is None:
        raise InvalidArgument(
            "word_timestamps needs a forced aligner, which this server does not have "
            "(start the gateway with --aligner host:port)",
            param="word_timestamps",
        )
    check_alignable(job.language)


async def _stream_chunks(
    stream: SynthesisStream,
    out: OutputOptions,
    metrics: GatewayMetrics,
    sample_rate: int,
    aligner: AlignerClient | None = None,
) -> AsyncIterator[bytes]:
    """Encoded audio (or SSE events) as the talker produces it; always closes `stream`."""
    is_sse = out.stream_format == "sse"
    timestamps = is_sse and out.word_timestamps and aligner is not None
    output = AudioOutput(out.response_format, sample_rate, out.speed, keep_native=timestamps)
    clock = PlaybackClock(metrics, out.speed)
    error: BaseException | None = None
    try:
        async with contextlib.aclosing(output.chunks(stream)) as chunks:
            async for chunk in chunks:
                if chunk.data:
                    yield sse.audio_delta(chunk.data) if is_sse else chunk.data
                if not chunk.last:
                    # The response sends each chunk before asking for the next: it is on the
                    # connection now (an encoder may have held some talker samples back before).
                    clock.handed_on(chunk.talker_samples)
        if timestamps:
            job = stream.job
            words = await aligner.try_align(
                job.request_id, job.text, job.language, b"".join(output.native_pcm), speed=out.speed
            )
            yield sse.timestamps_event(words, request_id=job.request_id)
        if is_sse:
            s = stream.summary
            yield sse.audio_done(
                s.num_input_tokens if s else 0,
                s.num_frames if s else 0,
                finish_reason=s.finish_reason if s else None,
                request_id=stream.job.request_id,
            )
    except Exception as exc:
        error = exc
        metrics.error(mapping_for(exc).grpc_code.name)
        if not isinstance(exc, TTSError):
            log.error("stream %s failed", stream.job.request_id, exc_info=exc)
        if not is_sse:
            raise  # aborts the connection: the client sees a truncated stream, not a clean end
        yield sse.error_event(exc)
    except BaseException as exc:
        error = exc
        raise
    finally:
        await stream.close(error)


def create_app(deps: HttpDeps) -> FastAPI:
    """Build the FastAPI app around injected dependencies (no globals)."""
    app = FastAPI(title="Qwen3-TTS gateway", docs_url=None, redoc_url=None)
    install_openapi(app)
    install_docs_pages(app)
    _add_middleware(app, deps)
    install_abort_log_filter()
    _add_error_handlers(app, deps.metrics)
    # Routes in the order they have always been registered: the OpenAPI document lists them so.
    _add_speech_routes(app, deps)
    _add_model_routes(app, deps.synthesizer)
    _add_health_routes(app, deps)
    _add_playground_routes(app, deps)
    add_voice_collection_routes(app, deps.voices, deps.consents)
    app.include_router(consent_router(deps.consents))
    app.include_router(batch_router(deps.synthesizer))
    add_voice_item_routes(app, deps.voices)
    return app


def _add_middleware(app: FastAPI, deps: HttpDeps) -> None:
    """The early speech refusal, body limits, rate limit, client identity and API keys (the last
    added runs first)."""
    synth, metrics = deps.synthesizer, deps.metrics

    def refuse(busy: TTSError) -> JSONResponse:
        synth.reject("http", busy)
        return error_response(busy, metrics)

    def speech_route():
        return next(r for r in app.routes if getattr(r, "path", None) == SPEECH_PATH)

    app.add_middleware(
        EarlyRefusalMiddleware, refusal=lambda: synth.early_refusal(), respond=refuse, route=speech_route
    )
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=deps.max_body_bytes,
        body_timeout_s=deps.body_timeout_s,
        body_deadline_s=deps.body_deadline_s,
    )
    if deps.rate_limiter is not None:
        app.add_middleware(RateLimitMiddleware, limiter=deps.rate_limiter)  # inside: the client is known
    keys_enabled = deps.api_keys is not None and deps.api_keys.enabled
    app.add_middleware(ClientIdentityMiddleware, keys_enabled=keys_enabled)
    if deps.api_keys is not None and deps.api_keys.enabled:
        app.add_middleware(ApiKeyMiddleware, keys=deps.api_keys)


def _add_error_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    """Every error answers in OpenAI's shape, whatever raised it."""

    @app.exception_handler(TTSError)
    async def _tts_error(_: Request, exc: TTSError) -> JSONResponse:
        return error_response(exc, metrics)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Still OpenAI-shaped; the message hides internals, the traceback goes to the log.
        return error_response(exc, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = {
            "error": {
                "message": str(exc.detail),
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        if exc.status_code == 404:
            body["error"].update(type="not_found_error", code="not_found")
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidArgument(str(exc.errors())), metrics)


def _add_speech_routes(app: FastAPI, deps: HttpDeps) -> None:
    """POST /v1/audio/speech and its WebSocket twin /v1/audio/speech/stream."""
    synth, metrics = deps.synthesizer, deps.metrics

    @app.post(
        "/v1/audio/speech", response_class=Response, responses=SPEECH_RESPONSES, openapi_extra=SPEECH_OPENAPI
    )
    async def speech(request: Request) -> Response:
        """OpenAI `audio.speech.create`, plus Qwen3-TTS fields (task_type, ref_audio, ...)."""
        # At the stream limit or with no talker room, refused before the body is read: a voice
        # clone's body carries its clip (hundreds of KB), and reading and parsing it for every
        # refusal of a storm delays the audio of the admitted streams. The same answer as open()'s
        # refusal below; uvicorn discards the unread body once the answer is sent (the connection
        # stays usable). EarlyRefusalMiddleware gives it ahead of the routing; here it is made
        # again for a request let in there, which then holds its place while its body comes.
        with synth.early_admission() as busy:
            if busy is not None:
                synth.reject("http", busy)
                return error_response(busy, metrics)
            try:
                fields, out = parse_speech_body(await json_body(request))
                job = synth.validate(fields)
                check_output_format(out.response_format, job.sample_rate)
                if out.word_timestamps:
                    _check_word_timestamps(deps, job)
            except TTSError as exc:
                synth.reject("http", exc)
                return error_response(exc, metrics)
            try:
                stream = await synth.open(job, "http")
            except TTSError as exc:
                return error_response(exc, metrics)
        if out.streaming:
            return _streaming_speech(job, stream, out, deps)
        if out.word_timestamps:
            return await _whole_speech_with_timestamps(request, job, stream, out, deps)
        return await _whole_speech(request, job, stream, out, metrics)

    speech_stream_endpoint = SpeechStreamEndpoint(
        synth,
        write_timeout_s=deps.write_timeout_s,
        aligner=deps.aligner,
        idle_timeout_s=deps.stream_idle_timeout_s,
        **({"max_message_bytes": deps.ws_max_message_bytes} if deps.ws_max_message_bytes else {}),
    )

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket) -> None:
        """Text streamed in, audio streamed out: vLLM-Omni's streaming speech protocol (speech_ws.py)."""
        await speech_stream_endpoint(websocket)


def _streaming_speech(
    job: SynthesisJob, stream: SynthesisStream, out: OutputOptions, deps: HttpDeps
) -> Response:
    """The audio (or SSE events) sent as the talker produces it; the stream closes with the body."""
    media = "text/event-stream" if out.stream_format == "sse" else MEDIA_TYPES[out.response_format]
    headers = {
        "x-request-id": job.request_id,
        "x-tts-sample-rate": str(job.sample_rate),
        **ignored_fields_header(job),
        "cache-control": "no-cache",
    }
    return DisconnectAwareStreamingResponse(
        _stream_chunks(stream, out, deps.metrics, job.sample_rate, deps.aligner),
        headers=headers,
        media_type=media,
        write_timeout_s=deps.write_timeout_s,
        request_id=job.request_id,
    )


async def _whole_speech(
    request: Request, job: SynthesisJob, stream: SynthesisStream, out: OutputOptions, metrics: GatewayMetrics
) -> Response:
    """The whole clip in one body, with the summary headers; always closes `stream`."""
    error: BaseException | None = None
    try:
        output = AudioOutput(out.response_format, job.sample_rate, out.speed, streaming=False)
        audio = await run_unless_disconnected(request, lambda: output.collect(stream))
        stream.first_byte_sent()
        return Response(
            audio,
            media_type=MEDIA_TYPES[out.response_format],
            headers=_result_headers(stream, job.sample_rate),
        )
    except TTSError as exc:
        error = exc
        return error_response(exc, metrics)
    except BaseException as exc:
        error = exc
        raise
    finally:
        await stream.close(error)


async def _whole_speech_with_timestamps(
    request: Request, job: SynthesisJob, stream: SynthesisStream, out: OutputOptions, deps: HttpDeps
) -> Response:
    """The whole clip and its word timestamps as one JSON object (the audio base64 in `audio`);
    always closes `stream`. An aligner failure leaves `timestamps` null, as vLLM-Omni does."""
    error: BaseException | None = None
    try:
        output = AudioOutput(
            out.response_format, job.sample_rate, out.speed, streaming=False, keep_native=True
        )
        audio = await run_unless_disconnected(request, lambda: output.collect(stream))
        words = await run_unless_disconnected(
            request,
            lambda: deps.aligner.try_align(
                job.request_id, job.text, job.language, b"".join(output.native_pcm), speed=out.speed
            ),
        )
        stream.first_byte_sent()
        s = stream.summary
        body = {
            "object": "audio.speech",
            "request_id": job.request_id,
            "response_format": out.response_format,
            "sample_rate": job.sample_rate,
            "audio": base64.b64encode(audio).decode("ascii"),
            "timestamps": words,
            "finish_reason": s.finish_reason if s else None,
            "usage": sse.usage(s.num_input_tokens if s else 0, s.num_frames if s else 0),
        }
        return JSONResponse(body, headers=_result_headers(stream, job.sample_rate))
    except TTSError as exc:
        error = exc
        return error_response(exc, deps.metrics)
    except BaseException as exc:
        error = exc
        raise
    finally:
        await stream.close(error)


def _add_model_routes(app: FastAPI, synth: GatewayCore) -> None:
    """GET /v1/models and /v1/models/{model_id}: the one model this server serves."""

    @app.get("/v1/models")
    async def models() -> dict:

        catalog = synth.catalog()
        return {
            "object": "list",
            "data": [
                {
                    "id": catalog.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "qwen",
                    "model_type": catalog.model_type,
                    "model_size": catalog.model_size,
                },
            ],
        }

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict:
        catalog = synth.catalog()
        if model_id != catalog.name:
            raise NotFound(f"model {model_id!r} does not exist; this server serves {catalog.name!r}")
        return {"id": catalog.name, "object": "model", "created": 0, "owned_by": "qwen"}


def _add_health_routes(app: FastAPI, deps: HttpDeps) -> None:
    """GET /livez (liveness) and /health = /readyz (readiness)."""
    synth = deps.synthesizer

    @app.get("/livez")
    async def livez() -> dict:
        """Liveness: the process and its event loop answer (a stage being down is not a reason to
        restart the gateway)."""
        return {"status": "ok"}

    @app.get("/health")
    @app.get("/readyz")
    async def health() -> JSONResponse:
        """Readiness: 200 when the model is known and the talker is SERVING. speaker_cache (and its
        Redis) only serves the voice API: when it is down the gateway stays ready, synthesis with
        inline clips and presets goes on, and the body says `degraded`."""
        stages = await deps.stage_health()
        ready = synth.ready
        ok = ready and all(stages.get(name, "SERVING") == "SERVING" for name in REQUIRED_STAGES)
        degraded = ok and any(status != "SERVING" for status in stages.values())
        body = {
            "status": "degraded" if degraded else "ok" if ok else "unavailable",
            "model_loaded": ready,
            "stages": stages,
        }
        return JSONResponse(body, status_code=200 if ok else 503)


def _add_playground_routes(app: FastAPI, deps: HttpDeps) -> None:
    """The playground page (GET /, /static) and the load figures it shows (GET /v1/status)."""
    status = deps.status or StatusReporter(deps.synthesizer)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-cache"})

    @app.get("/v1/status")
    async def load_status() -> dict:
        """The served model and load figures (active streams, queue, step time) for the playground."""
        return await status.snapshot()
