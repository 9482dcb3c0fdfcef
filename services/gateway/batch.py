"""`POST /v1/audio/speech/batch`: several inputs in one call, as vLLM-Omni's batch speech API.

The body is vLLM-Omni's `BatchSpeechRequest`: `items` (each at least an `input`) and, beside them,
the speech fields every item takes unless it sets its own. Each item is validated like a
`/v1/audio/speech` body and synthesised as one non-streaming request, a few at a time, each under
the same admission as any other stream. The answer is vLLM-Omni's `BatchSpeechResponse`: one result
per item in order, the audio base64-encoded, and an item that fails says why without failing the
others.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any

from fastapi import APIRouter, Request

from qtts.request.errors import InvalidArgument, TTSError

from .audio_encoding import MEDIA_TYPES, check_output_format
from .audio_output import AudioOutput
from .core import GatewayCore
from .http_body import parse_json
from .http_request import parse_speech_body
from .http_streaming import run_unless_disconnected

# vLLM-Omni bounds a batch at 32 items.
MAX_BATCH_ITEMS = 32
# Items synthesised at once: the rest wait, so one batch does not take every stream slot.
BATCH_CONCURRENCY = 4
# The fields vLLM-Omni's BatchSpeechRequest takes beside `items` (shared defaults of every item).
SHARED_FIELDS = frozenset(
    {
        "voice",
        "speaker",
        "instructions",
        "response_format",
        "sample_rate",
        "speed",
        "task_type",
        "language",
        "ref_audio",
        "ref_text",
        "x_vector_only_mode",
        "max_new_tokens",
        "initial_codec_chunk_frames",
        "non_streaming_mode",
    }
)
DEFAULT_FORMAT = "wav"  # vLLM-Omni's batch default (a single /v1/audio/speech defaults to mp3)


def item_bodies(body: Any) -> list[Any]:
    """Each item's `/v1/audio/speech` body: the shared fields, then the item's own non-null ones."""
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object with items")
    unknown = sorted(set(body) - SHARED_FIELDS - {"model", "items"})
    if unknown:
        raise InvalidArgument(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    items = body.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_ITEMS:
        raise InvalidArgument(f"items must be a list of 1..{MAX_BATCH_ITEMS} objects", param="items")
    shared = {k: v for k, v in body.items() if k in SHARED_FIELDS and v is not None}
    if body.get("model") is not None:
        shared["model"] = body["model"]
    shared.setdefault("response_format", DEFAULT_FORMAT)
    out = []
    for item in items:
        if not isinstance(item, dict):
            out.append(item)  # reported as that item's error
            continue
        own = {k: v for k, v in item.items() if v is not None}
        if "speaker" in own:  # an item's speaker replaces the shared voice, and the other way round
            shared_item = {k: v for k, v in shared.items() if k != "voice"}
        elif "voice" in own:
            shared_item = {k: v for k, v in shared.items() if k != "speaker"}
        else:
            shared_item = shared
        out.append({**shared_item, **own, "stream": False})
    return out


async def _synthesise(synth: GatewayCore, body: Any) -> tuple[bytes, str, dict]:
    fields, out = parse_speech_body(body)
    try:
        job = synth.validate(fields)
        check_output_format(out.response_format, job.sample_rate)
    except TTSError as exc:
        synth.reject("http", exc)
        raise
    stream = await synth.open(job, "http")
    error: BaseException | None = None
    try:
        output = AudioOutput(out.response_format, job.sample_rate, out.speed, streaming=False)
        audio = await output.collect(stream)
        stream.first_byte_sent()
        summary = stream.summary
        usage = (
            {"output_tokens": summary.num_frames, "input_tokens": summary.num_input_tokens} if summary else {}
        )
        return audio, MEDIA_TYPES[out.response_format], usage
    except BaseException as exc:
        error = exc
        raise
    finally:
        await stream.close(error)


async def run_batch(synth: GatewayCore, body: Any) -> dict:
    """vLLM-Omni's BatchSpeechResponse for `body` (a malformed batch itself raises InvalidArgument)."""
    bodies = item_bodies(body)
    gate = asyncio.Semaphore(BATCH_CONCURRENCY)

    async def one(index: int, item: Any) -> dict:
        async with gate:
            try:
                audio, media, usage = await _synthesise(synth, item)
            except TTSError as exc:
                result = {"index": index, "status": "error", "error": exc.message}
                return {**result, "param": exc.param} if exc.param else result
        done = {
            "index": index,
            "status": "success",
            "audio_data": base64.b64encode(audio).decode(),
            "media_type": media,
        }
        if usage:
            done["usage"] = {**usage, "total_tokens": sum(usage.values())}
        return done

    results = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    ok = sum(r["status"] == "success" for r in results)
    return {
        "id": f"speech-batch-{secrets.token_hex(12)}",
        "results": results,
        "total": len(results),
        "succeeded": ok,
        "failed": len(results) - ok,
    }


def batch_router(synth: GatewayCore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/audio/speech/batch")
    async def speech_batch(request: Request) -> dict:
        """vLLM-Omni's batch speech: `items` plus shared defaults; one result per item."""
        body = parse_json(await request.body())
        return await run_unless_disconnected(request, lambda: run_batch(synth, body))

    return router
