"""Validation of a synthesis request against the served model; every failure is a clear TTSError.

`build_job` is the gateway's one pass: the typed request (`SpeechFields`, whichever transport
brought it) goes through `qtts.request.vocabulary.check_request` once, with the gateway's own
bounds (`RequestLimits`) and instructions policy, and the job for the talker is built from what
that pass returns."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from qtts.request.errors import InvalidArgument
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE, Task, check_request
from qtts.serving.log_context import current_request_id

from .auth import scoped_voice_name
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


def build_job(
    fields: SpeechFields,
    catalog: ModelCatalog,
    limits: RequestLimits,
    unsupported_instructions: str = "reject",
    owner: str = "",
) -> SynthesisJob:
    """Check `fields` against the served model and the limits in one pass; return the job for
    the talker. `owner`: the API key's voice owner, whose stored voices a clone names (auth.py)."""
    reference_audio = fields.reference_audio or None
    checked = check_request(
        fields,
        catalog,
        has_reference=reference_audio is not None,
        edge=limits,
        unsupported_instructions=unsupported_instructions,
    )
    voice = checked.voice
    if checked.task == Task.VOICE_CLONE and voice and reference_audio is None and owner:
        voice = scoped_voice_name(voice, owner)  # the key's own stored voice
    return SynthesisJob(
        request_id=fields.request_id or current_request_id() or new_request_id(),
        # As received where more text follows (streamed): a space at its end belongs to the next word.
        text=fields.text if fields.text_follows else checked.text,
        task=checked.task,
        voice=voice,
        language=checked.language,
        instructions=checked.instructions,
        reference_audio=reference_audio,
        reference_text=checked.reference_text,
        x_vector_only=checked.x_vector_only,
        max_new_frames=checked.max_new_frames,
        sampling=checked.sampling,
        sample_rate=checked.sample_rate,
        first_chunk_frames=fields.first_chunk_frames,
        chunk_frames_ramp=tuple(fields.chunk_frames_ramp),
        streaming_text=fields.streaming_text,
        ignored_fields=checked.ignored_fields,
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
