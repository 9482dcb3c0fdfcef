"""Validation of a synthesis request against the served model; every failure is a clear TTSError."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from qtts import request_limits as lim
from qtts.errors import InvalidArgument, NotFound
from qtts.log_context import current_request_id

from .job import TASKS, ModelCatalog, SamplingOptions, SpeechFields, SynthesisJob

# vLLM-Omni's task_type spellings (the model variants' own names), lower-cased.
TASK_ALIASES = {"base": "voice_clone", "customvoice": "custom_voice", "voicedesign": "voice_design"}
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000


@dataclass(frozen=True)
class RequestLimits:
    """Bounds the gateway enforces on every request."""

    max_input_chars: int = 4096
    max_new_frames_limit: int = 4096
    max_ref_audio_bytes: int = 20 * 1024 * 1024
    # Output rate when a request does not ask for one.
    default_sample_rate: int = 24000


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def check_model(model: str, catalog: ModelCatalog) -> None:
    """Unknown model names are 404, as in the OpenAI API; empty means the served model."""
    if model and model != catalog.name:
        raise NotFound(f"model {model!r} does not exist; this server serves {catalog.name!r}", param="model")


def _check_sampling(s: SamplingOptions) -> SamplingOptions:
    lim.check_sampling(s)  # the same ranges as the HTTP model's and the talker's
    # Temperature 0 means deterministic decoding, as in the OpenAI sampling APIs.
    if s.temperature == 0 and not s.greedy:
        return dataclasses.replace(s, temperature=None, greedy=True)
    return s


# ISO 639-1 codes (as vLLM-Omni's clients send them, optionally with a region: en-US, pt_BR) -> the
# model's language names.
LANGUAGE_CODES = {
    "zh": "chinese",
    "en": "english",
    "de": "german",
    "es": "spanish",
    "ja": "japanese",
    "fr": "french",
    "ko": "korean",
    "ru": "russian",
    "it": "italian",
    "pt": "portuguese",
}


def _language(language: str | None, catalog: ModelCatalog) -> str:
    lang = (language or "auto").strip().lower()
    if lang == "auto":
        return lang
    lang = LANGUAGE_CODES.get(lang.replace("_", "-").split("-")[0], lang)
    if catalog.languages and lang not in catalog.languages:
        raise InvalidArgument(
            f"unsupported language {language!r}; supported: auto, {', '.join(sorted(catalog.languages))}",
            param="language",
        )
    return lang


def _check_strings(fields: SpeechFields) -> None:
    """Every string field within its limit and valid Unicode (gRPC's as well as HTTP's)."""
    for value, param, max_chars in (
        (fields.text, "input", lim.TEXT_MAX_CHARS),
        (fields.model, "model", lim.MODEL_MAX_CHARS),
        (fields.task, "task_type", lim.TASK_MAX_CHARS),
        (fields.voice, "voice", lim.VOICE_MAX_CHARS),
        (fields.language, "language", lim.LANGUAGE_MAX_CHARS),
        (fields.instructions, "instructions", lim.INSTRUCTIONS_MAX_CHARS),
        (fields.reference_text, "ref_text", lim.REF_TEXT_MAX_CHARS),
        (fields.request_id, "request_id", lim.DERIVED_REQUEST_ID_MAX_CHARS),
    ):
        lim.check_string(value, param, max_chars)


def build_job(fields: SpeechFields, catalog: ModelCatalog, limits: RequestLimits) -> SynthesisJob:
    """Check `fields` against the served model and the limits; return the job for the talker."""
    _check_strings(fields)
    check_model(fields.model, catalog)
    text = (fields.text or "").strip()
    if not text:
        raise InvalidArgument("input must be a non-empty string", param="input")
    if len(text) > limits.max_input_chars:
        raise InvalidArgument(
            f"input is {len(text)} characters long; the limit is {limits.max_input_chars}", param="input"
        )
    if not lim.has_speakable_text(text):
        raise InvalidArgument(
            "input has nothing to speak (only whitespace or control characters)", param="input"
        )
    lim.check_chunking(fields.first_chunk_frames, fields.chunk_frames_ramp)
    task = (fields.task or catalog.task).strip().lower()
    task = TASK_ALIASES.get(task, task)
    if task not in TASKS:
        raise InvalidArgument(
            f"task_type must be one of {', '.join(TASKS)} (or Base, CustomVoice, VoiceDesign), "
            f"got {fields.task!r}",
            param="task_type",
        )
    if task != catalog.task:
        raise InvalidArgument(
            f"task_type {task!r} is not served by model {catalog.name!r} "
            f"({catalog.model_type} variant, which serves {catalog.task!r})",
            param="task_type",
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
    voice = (fields.voice or "").strip()
    instructions = (fields.instructions or "").strip()
    ref_text = (fields.reference_text or "").strip()
    ref_audio = fields.reference_audio or None
    x_vector_only = bool(fields.x_vector_only)

    if task == "voice_clone":
        if ref_audio is not None:
            if len(ref_audio) > limits.max_ref_audio_bytes:
                raise InvalidArgument(
                    f"ref_audio is {len(ref_audio)} bytes; the limit is {limits.max_ref_audio_bytes}",
                    param="ref_audio",
                )
            if not x_vector_only and not ref_text:
                raise InvalidArgument(
                    "ref_text (the transcript of ref_audio) is required unless x_vector_only_mode is true",
                    param="ref_text",
                )
            if x_vector_only:
                ref_text = ""
        elif not voice:
            raise InvalidArgument(
                "voice clone needs ref_audio, or voice naming a stored voice", param="voice"
            )
        else:
            # A stored voice carries its own transcript and mode.
            ref_text, x_vector_only = "", False
    elif task == "custom_voice":
        if ref_audio is not None:
            raise InvalidArgument("ref_audio is only used for voice_clone", param="ref_audio")
        voice = voice.lower()
        if not voice:
            raise InvalidArgument(
                f"voice is required; speakers: {', '.join(sorted(catalog.speakers))}", param="voice"
            )
        if catalog.speakers and voice not in catalog.speakers:
            raise NotFound(
                f"unknown speaker {fields.voice!r}; available: {', '.join(sorted(catalog.speakers))}",
                param="voice",
            )
    else:  # voice_design
        if ref_audio is not None:
            raise InvalidArgument("ref_audio is only used for voice_clone", param="ref_audio")
        if not instructions:
            raise InvalidArgument(
                "voice_design needs instructions describing the voice", param="instructions"
            )
        voice = ""

    return SynthesisJob(
        request_id=fields.request_id or current_request_id() or new_request_id(),
        text=text,
        task=task,
        voice=voice,
        language=_language(fields.language, catalog),
        instructions=instructions,
        reference_audio=ref_audio,
        reference_text=ref_text,
        x_vector_only=x_vector_only,
        max_new_frames=fields.max_new_frames or 0,
        sampling=_check_sampling(fields.sampling),
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
