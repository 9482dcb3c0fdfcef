"""Validation of a synthesis request against the served model; every failure is a clear TTSError."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument, NotFound
from qtts.request.sampling_overrides import zero_means_greedy
from qtts.request.vocabulary import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, NATIVE_SAMPLE_RATE, Task, check_request
from qtts.serving.log_context import current_request_id

from .job import ModelCatalog, SpeechFields, SynthesisJob


@dataclass(frozen=True)
class RequestLimits:
    """Bounds the gateway enforces on every request."""

    max_input_chars: int = 4096
    max_new_frames_limit: int = 4096
    max_ref_audio_bytes: int = 20 * 1024 * 1024
    # Output rate when a request does not ask for one.
    default_sample_rate: int = NATIVE_SAMPLE_RATE
    # Streamed text: one input.text piece, and one utterance's text (text_stream.TextBudget).
    max_text_piece_chars: int = 65536
    max_utterance_chars: int = 262144


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def check_model(model: str, catalog: ModelCatalog) -> None:
    """Unknown model names are 404, as in the OpenAI API; empty means the served model."""
    if model and model != catalog.name:
        raise NotFound(f"model {model!r} does not exist; this server serves {catalog.name!r}", param="model")


def build_job(fields: SpeechFields, catalog: ModelCatalog, limits: RequestLimits) -> SynthesisJob:
    """Check `fields` against the served model and the limits; return the job for the talker."""
    lim.check_string(fields.model, "model", lim.MODEL_MAX_CHARS)
    check_model(fields.model, catalog)
    ref_audio = fields.reference_audio or None

    def check_ref_size() -> None:
        if len(ref_audio) > limits.max_ref_audio_bytes:
            raise InvalidArgument(
                f"ref_audio is {len(ref_audio)} bytes; the limit is {limits.max_ref_audio_bytes}",
                param="ref_audio",
            )

    checked = check_request(
        fields,
        catalog,
        has_reference=ref_audio is not None,
        check_reference=check_ref_size,
        max_text_chars=limits.max_input_chars,
    )
    if fields.max_new_frames is not None and not (1 <= fields.max_new_frames <= limits.max_new_frames_limit):
        raise InvalidArgument(
            f"max_new_tokens must be in 1..{limits.max_new_frames_limit}, got {fields.max_new_frames}",
            param="max_new_tokens",
        )
    sample_rate = fields.sample_rate or limits.default_sample_rate
    if not (MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE):
        raise InvalidArgument(
            f"sample_rate must be in {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz, got {sample_rate}",
            param="sample_rate",
        )
    ref_text = (fields.reference_text or "").strip()
    x_vector_only = bool(fields.x_vector_only)
    if checked.task == Task.VOICE_CLONE and ref_audio is None:
        # A stored voice carries its own transcript and mode.
        ref_text, x_vector_only = "", False
    elif checked.task == Task.VOICE_CLONE and x_vector_only:
        ref_text = ""

    return SynthesisJob(
        request_id=fields.request_id or current_request_id() or new_request_id(),
        text=fields.text.strip(),
        task=checked.task,
        voice=checked.voice,
        language=checked.language,
        instructions=(fields.instructions or "").strip(),
        reference_audio=ref_audio,
        reference_text=ref_text,
        x_vector_only=x_vector_only,
        max_new_frames=fields.max_new_frames or 0,
        # Temperature 0 means deterministic decoding, as in the OpenAI sampling APIs.
        sampling=zero_means_greedy(fields.sampling),
        sample_rate=sample_rate,
        first_chunk_frames=fields.first_chunk_frames,
        chunk_frames_ramp=tuple(fields.chunk_frames_ramp),
        streaming_text=fields.streaming_text,
    )


def named_field(exc: InvalidArgument, field: str) -> InvalidArgument:
    """`exc` naming `field` in its message and its param, unless it names one already."""
    if exc.param:
        return exc
    return InvalidArgument(f"{field}: {exc.message}", param=field)


_VOICE_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_voice_name(name: str) -> str:
    """Voice names are 1-64 characters of letters, digits, '_', '-', '.'."""
    name = (name or "").strip()
    if not name:
        raise InvalidArgument("voice name is required", param="name")
    if len(name) > 64 or not set(name) <= _VOICE_NAME_CHARS:
        shown = repr(name) if len(name) <= 80 else f"{name[:64]!r}... ({len(name)} characters)"
        raise InvalidArgument(
            f"voice name {shown} must be 1-64 characters of letters, digits, '_', '-' or '.'",
            param="name",
        )
    return name
