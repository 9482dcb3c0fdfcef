"""Server-sent events framing of `stream_format=sse` (OpenAI `speech.audio.delta` / `.done`)."""

from __future__ import annotations

import base64
import json

from qtts.request.errors import openai_error_body


def sse_event(payload: dict) -> bytes:
    """One SSE event: a `data:` line of compact JSON and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def audio_delta(audio: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")})


def usage(input_tokens: int, output_tokens: int) -> dict:
    """Usage counts the input's text tokens (the model's tokenizer, as the talker reports them) and
    the generated codec frames."""
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }


def audio_done(input_tokens: int, output_tokens: int, **extra) -> bytes:
    """The final event, with usage."""
    return sse_event({"type": "speech.audio.done", "usage": usage(input_tokens, output_tokens), **extra})


def timestamps_event(words: list[dict] | None, **extra) -> bytes:
    """The word timestamps of the audio sent before it (`{word, start_ms, end_ms}` each; null when
    the aligner failed, as vLLM-Omni sends them)."""
    return sse_event({"type": "speech.audio.timestamps", "timestamps": words, **extra})


def error_event(exc: BaseException) -> bytes:
    """An error after the first byte: the HTTP status is gone, so the error travels as an event."""
    return sse_event({"type": "error", **openai_error_body(exc)})
