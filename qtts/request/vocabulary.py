"""The words every request is made of: tasks, languages, sample rates, and the one check of a
request against the served model that the gateway and the talker both run.

Pure (no torch, no protobuf): the gateway checks a client's request with it before any work is
done, and the talker checks again, so a direct talker caller meets the same rules. `check_request`
is one pass over the request's fields, each checked once and normalised into a `CheckedRequest`;
the gateway adds its own bounds (`edge`: model name, text length, reference size, frame cap,
output rate, instructions policy) to the same pass. Each caller names the fields as its own API
spells them (`FieldNames`), so an error's message and `param` speak the caller's language.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument, NotFound
from qtts.request.model_variants import supports_instructions, unsupported_instructions
from qtts.request.sampling_overrides import SamplingOverrides, check_sampling, zero_means_greedy


class Task(StrEnum):
    """What a request asks of the model; each model variant serves exactly one."""

    VOICE_CLONE = "voice_clone"
    CUSTOM_VOICE = "custom_voice"
    VOICE_DESIGN = "voice_design"


TASKS: tuple[str, ...] = tuple(t.value for t in Task)
# The one task each model variant serves (config.json `tts_model_type` -> task).
TASK_OF_MODEL_TYPE: dict[str, str] = {
    "base": Task.VOICE_CLONE.value,
    "custom_voice": Task.CUSTOM_VOICE.value,
    "voice_design": Task.VOICE_DESIGN.value,
}
# vLLM-Omni's task_type spellings (the model variants' own names), lower-cased.
TASK_ALIASES = {"base": "voice_clone", "customvoice": "custom_voice", "voicedesign": "voice_design"}

# The talker's PCM: 24 kHz, 1920 samples (80 ms) a frame. Output may be resampled within the range.
NATIVE_SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000


@dataclass(frozen=True)
class AudioPiece:
    """A chunk of the talker's PCM (s16le mono, 24 kHz) covering generated frames
    [first_frame_index, first_frame_index + num_frames)."""

    pcm_s16le: bytes
    first_frame_index: int
    num_frames: int

    @property
    def num_samples(self) -> int:
        return len(self.pcm_s16le) // 2


@dataclass(frozen=True)
class SynthesisSummary:
    """How a request ended, in the talker and in the gateway alike: finish reason "stop" (end of
    speech) or "length" (the frame limit), sizes, stage timings and the code2wav replica that
    decoded it."""

    finish_reason: str
    num_frames: int
    num_samples: int
    code2wav_replica: str = ""
    queue_ns: int = 0
    prefill_ns: int = 0
    first_audio_ns: int = 0
    total_ns: int = 0
    num_input_tokens: int = 0


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


def served_task(model_type: str) -> str | None:
    """The task a model variant serves; None for a model type this code does not know."""
    return TASK_OF_MODEL_TYPE.get(model_type)


def language_name(language: str | None) -> str:
    """The model's name for `language` (a name in any case, or an ISO 639-1 code), or auto."""
    lang = (language or "auto").strip().lower()
    if lang == "auto":
        return lang
    return LANGUAGE_CODES.get(lang.replace("_", "-").split("-")[0], lang)


class ServedModel(Protocol):
    """What a check needs of the served model (the gateway's catalog, the talker's model info)."""

    name: str
    model_type: str
    speakers: Collection[str]
    languages: Collection[str]


class RequestFields(Protocol):
    """The fields a check reads; None and "" both mean "not set". `text` None (the gateway's
    streamed session, before its text) skips the text's checks."""

    text: str | None
    task: str | None
    voice: str | None
    language: str | None
    instructions: str | None
    reference_text: str | None
    x_vector_only: bool
    request_id: str
    sampling: SamplingOverrides
    first_chunk_frames: int
    chunk_frames_ramp: Sequence[int]


class EdgeFields(RequestFields, Protocol):
    """What the public edge (the gateway) reads besides: the model asked for, the encoded
    reference clip, the frame cap and the output rate."""

    model: str
    reference_audio: bytes | None
    max_new_frames: int | None
    sample_rate: int | None


class EdgeModel(ServedModel, Protocol):
    """What the edge needs of the served model besides: its size (which variants take instructions)."""

    model_size: str


class EdgeLimits(Protocol):
    """The edge's own bounds, tighter than the declared ranges (the gateway's RequestLimits)."""

    max_input_chars: int
    max_new_frames_limit: int
    max_ref_audio_bytes: int
    default_sample_rate: int


@dataclass(frozen=True)
class FieldNames:
    """How an API spells each field, in messages and `param` (the HTTP API's by default)."""

    text: str = "input"
    task: str = "task_type"
    voice: str = "voice"
    language: str = "language"
    instructions: str = "instructions"
    reference_audio: str = "ref_audio"
    reference_text: str = "ref_text"
    x_vector_only: str = "x_vector_only_mode"
    request_id: str = "request_id"


HTTP_FIELDS = FieldNames()

# OpenAI's preset voice names: not voices here unless one was stored under that name.
OPENAI_VOICE_NAMES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
)  # fmt: skip
# How the message of an unknown stored voice starts (the gateway recognises it from the talker).
UNKNOWN_VOICE = "no voice is stored under the name"


def unknown_voice(name: str, param: str | None = "voice") -> NotFound:
    """The error of a request naming a stored voice that does not exist: where the voices are
    listed, and that OpenAI's preset names are not presets here."""
    return NotFound(
        f"{UNKNOWN_VOICE} {name!r}: the stored voices are listed at GET /v1/audio/voices (gRPC: "
        f"ListVoices). OpenAI's preset names ({', '.join(OPENAI_VOICE_NAMES)}) are not voices here "
        "unless one was stored under that name; store a voice (POST /v1/audio/voices) or send a "
        "clip in ref_audio",
        param=param,
    )


TALKER_FIELDS = FieldNames(
    text="text",
    task="task",
    reference_audio="reference_pcm_f32",
    reference_text="reference_text",
    x_vector_only="x_vector_only",
)


@dataclass(frozen=True)
class CheckedRequest:
    """What a request resolves to on the served model, every field checked and normalised.

    `voice`: the preset speaker (the model's spelling) for custom_voice, the stored voice's name
    (or "") for voice_clone, "" for voice_design. `text`, `instructions`, `reference_text`:
    stripped; a voice clone from a stored voice, or from the x-vector alone, takes no transcript.
    `sampling`: temperature 0 turned into greedy decoding. The rest is the edge's (`check_request`
    with `edge`): `max_new_frames` (0: the talker's cap), the output `sample_rate`, and the fields
    the served variant ignores (`ignored_fields`, dropped under the "ignore" instructions policy)."""

    task: str
    language: str
    voice: str
    text: str = ""
    instructions: str = ""
    reference_text: str = ""
    x_vector_only: bool = False
    sampling: SamplingOverrides = SamplingOverrides()
    max_new_frames: int = 0
    sample_rate: int = NATIVE_SAMPLE_RATE
    ignored_fields: tuple[str, ...] = ()

    @property
    def speaker(self) -> str | None:
        return self.voice if self.task == Task.CUSTOM_VOICE else None


def check_request(
    req: RequestFields,
    model: ServedModel,
    *,
    has_reference: bool,
    check_reference: Callable[[], None] | None = None,
    names: FieldNames = HTTP_FIELDS,
    edge: EdgeLimits | None = None,
    unsupported_instructions: str = "reject",
) -> CheckedRequest:
    """Check `req` against `model` in one pass, each field once, in this order: (at the edge) the
    model name; string limits; text; sampling; chunking; task; voice; language; (at the edge) the
    frame cap, the output rate and instructions the variant cannot take. Returns the checked,
    normalised request.

    Raises InvalidArgument, or NotFound for an unknown model or speaker. `has_reference`: the
    request carries a reference clip; `check_reference` checks its encoding (the caller's to know)
    where a voice clone takes it. `edge`: the public edge's bounds (`req` is then `EdgeFields` and
    `model` an `EdgeModel`): the talker, behind it, leaves it None. `unsupported_instructions`:
    at the edge, "reject" refuses instructions the served variant cannot take, "ignore" drops them
    and names them in `ignored_fields`."""
    if edge is not None:
        _check_model(req.model, model)
        check_reference = _reference_size_check(req.reference_audio, edge.max_ref_audio_bytes, names)
    _check_strings(req, names)
    text = _text(req.text, names, edge.max_input_chars if edge is not None else 0)
    check_sampling(req.sampling)  # the declared ranges, as the HTTP model's
    lim.check_chunking(req.first_chunk_frames, req.chunk_frames_ramp)
    task = _task(req.task, model, names)
    voice = _voice(task, req, model, has_reference, check_reference, names)
    language = _language(req.language, model, names)
    instructions, ignored = (req.instructions or "").strip(), ()
    max_new_frames, sample_rate = 0, NATIVE_SAMPLE_RATE
    if edge is not None:
        max_new_frames, sample_rate = _frames_and_rate(req, edge)
        instructions, ignored = _instructions(instructions, model, unsupported_instructions)
    reference_text, x_vector_only = (req.reference_text or "").strip(), bool(req.x_vector_only)
    if task == Task.VOICE_CLONE and (not has_reference or x_vector_only):
        # A stored voice carries its own transcript and mode; the x-vector alone needs none.
        reference_text, x_vector_only = "", x_vector_only and has_reference
    return CheckedRequest(
        task=task,
        language=language,
        voice=voice,
        text=text,
        instructions=instructions,
        reference_text=reference_text,
        x_vector_only=x_vector_only,
        # Temperature 0 means deterministic decoding, as in the OpenAI sampling APIs.
        sampling=zero_means_greedy(req.sampling),
        max_new_frames=max_new_frames,
        sample_rate=sample_rate,
        ignored_fields=ignored,
    )


def _frames_and_rate(req: EdgeFields, edge: EdgeLimits) -> tuple[int, int]:
    """The edge's frame cap (0: the talker's) and output rate, within the edge's bounds."""
    if req.max_new_frames is not None and not 1 <= req.max_new_frames <= edge.max_new_frames_limit:
        raise InvalidArgument(
            f"max_new_tokens must be in 1..{edge.max_new_frames_limit}, got {req.max_new_frames}",
            param="max_new_tokens",
        )
    sample_rate = req.sample_rate or edge.default_sample_rate
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
        raise InvalidArgument(
            f"sample_rate must be in {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz, got {sample_rate}",
            param="sample_rate",
        )
    return req.max_new_frames or 0, sample_rate


def _instructions(instructions: str, model: EdgeModel, policy: str) -> tuple[str, tuple[str, ...]]:
    """(instructions, ignored fields): unchanged where the variant takes them (or none were sent),
    else refused (`policy` "reject") or dropped and named ("ignore")."""
    if not instructions or supports_instructions(model.model_type, model.model_size):
        return instructions, ()
    if policy != "ignore":
        raise unsupported_instructions(model.name, model.model_type, model.model_size)
    return "", ("instructions",)


def _check_model(name: str, model: ServedModel) -> None:
    """Unknown model names are 404, as in the OpenAI API; empty means the served model."""
    lim.check_string(name, "model", lim.MODEL_MAX_CHARS)
    if name and name != model.name:
        raise NotFound(f"model {name!r} does not exist; this server serves {model.name!r}", param="model")


def _reference_size_check(audio: bytes | None, max_bytes: int, names: FieldNames) -> Callable[[], None]:
    """The edge's check of an encoded clip, run where a voice clone takes it: at most `max_bytes`."""

    def check() -> None:
        if audio is not None and len(audio) > max_bytes:
            raise InvalidArgument(
                f"{names.reference_audio} is {len(audio)} bytes; the limit is {max_bytes}",
                param=names.reference_audio,
            )

    return check


def _text(value: str | None, names: FieldNames, max_chars: int) -> str:
    """The stripped text: not empty, at most `max_chars` (0: the declared limit only), something
    to speak. None (a streamed session before its text) is not checked."""
    if value is None:
        return ""
    text = value.strip()
    if not text:
        raise InvalidArgument(f"{names.text} must be a non-empty string", param=names.text)
    if max_chars and len(text) > max_chars:
        raise InvalidArgument(
            f"{names.text} is {len(text)} characters long; the limit is {max_chars}", param=names.text
        )
    if not lim.has_speakable_text(text):
        raise InvalidArgument(
            f"{names.text} has nothing to speak (only whitespace or control characters)", param=names.text
        )
    return text


def _check_strings(req: RequestFields, names: FieldNames) -> None:
    """Every string field within its limit and valid Unicode."""
    for value, param, max_chars in (
        (req.text, names.text, lim.TEXT_MAX_CHARS),
        (req.task, names.task, lim.TASK_MAX_CHARS),
        (req.voice, names.voice, lim.VOICE_MAX_CHARS),
        (req.language, names.language, lim.LANGUAGE_MAX_CHARS),
        (req.instructions, names.instructions, lim.INSTRUCTIONS_MAX_CHARS),
        (req.reference_text, names.reference_text, lim.REF_TEXT_MAX_CHARS),
        (req.request_id, names.request_id, lim.DERIVED_REQUEST_ID_MAX_CHARS),
    ):
        lim.check_string(value, param, max_chars)


def _task(requested: str | None, model: ServedModel, names: FieldNames) -> str:
    """The requested task (the served one when unset), in any of its spellings, if served."""
    served = served_task(model.model_type)
    task = (requested or served or "").strip().lower()
    task = TASK_ALIASES.get(task, task)
    if task not in TASKS:
        raise InvalidArgument(
            f"{names.task} must be one of {', '.join(TASKS)} (or Base, CustomVoice, VoiceDesign), "
            f"got {requested!r}",
            param=names.task,
        )
    if task != served:
        raise InvalidArgument(
            f"{names.task} {task!r} is not served by model {model.name!r} "
            f"(a {model.model_type} model, which serves {served!r})",
            param=names.task,
        )
    return task


def _voice(
    task: str,
    req: RequestFields,
    model: ServedModel,
    has_reference: bool,
    check_reference: Callable[[], None] | None,
    names: FieldNames,
) -> str:
    voice = (req.voice or "").strip()
    if task == Task.VOICE_CLONE:
        if has_reference:
            if check_reference is not None:
                check_reference()
            if not req.x_vector_only and not (req.reference_text or "").strip():
                raise InvalidArgument(
                    f"{names.reference_text} (the transcript of {names.reference_audio}) is required "
                    f"unless {names.x_vector_only} is true",
                    param=names.reference_text,
                )
        elif not voice:
            raise InvalidArgument(
                f"voice clone needs reference audio ({names.reference_audio}), or {names.voice} naming "
                "a stored voice",
                param=names.voice,
            )
        return voice
    if has_reference:
        raise InvalidArgument(
            f"{names.reference_audio} is only used for voice_clone", param=names.reference_audio
        )
    if task == Task.CUSTOM_VOICE:
        speakers = {name.lower(): name for name in model.speakers}
        if not voice:
            raise InvalidArgument(
                f"{names.voice} is required (custom_voice needs a speaker); speakers: "
                f"{', '.join(sorted(speakers))}",
                param=names.voice,
            )
        if speakers and voice.lower() not in speakers:
            raise NotFound(
                f"unknown speaker {req.voice!r}; available: {', '.join(sorted(speakers))}", param=names.voice
            )
        return speakers.get(voice.lower(), voice.lower())
    if not (req.instructions or "").strip():
        raise InvalidArgument(
            "voice_design needs instructions describing the voice", param=names.instructions
        )
    return ""


def _language(language: str | None, model: ServedModel, names: FieldNames) -> str:
    lang = language_name(language)
    languages = {name.lower() for name in model.languages}
    if lang != "auto" and languages and lang not in languages:
        raise InvalidArgument(
            f"unsupported language {language!r}; supported: auto, {', '.join(sorted(languages))}",
            param=names.language,
        )
    return lang
