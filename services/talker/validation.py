"""Checks a request against the served model before any work is done, with messages a client can act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qtts import request_limits as lim
from qtts.errors import InvalidArgument, NotFound

from .request import CUSTOM_VOICE, TASK_OF_MODEL_TYPE, VOICE_CLONE, VOICE_DESIGN, GenerationRequest


@dataclass(frozen=True)
class CheckedRequest:
    """The task, language and speaker a request resolves to on the served model."""

    task: str
    language: str
    speaker: str | None


def check_request(req: GenerationRequest, info: Any) -> CheckedRequest:
    """Validate `req` against `info` (a `qtts.model.ModelInfo`); raises InvalidArgument/NotFound.

    The field ranges are the gateway's (`qtts.request_limits`), checked again here: a direct caller
    must not be able to put a row into a batch that fails the shared sampling step."""
    check_limits(req)
    if not lim.has_speakable_text(req.text):
        raise InvalidArgument("text is empty (or only whitespace and control characters)", param="text")
    served = TASK_OF_MODEL_TYPE.get(info.model_type)
    task = req.task or served
    if task not in TASK_OF_MODEL_TYPE.values():
        raise InvalidArgument(f"unknown task type {task!r}")
    if task != served:
        raise InvalidArgument(
            f"task {task} is not supported by the served model {info.name} "
            f"(a {info.model_type} model, which serves {served})"
        )
    language = (req.language or "auto").strip().lower()
    languages = {name.lower() for name in info.languages}
    if language != "auto" and language not in languages:
        raise InvalidArgument(
            f"unsupported language {req.language!r}; supported: auto, {', '.join(sorted(languages))}"
        )
    speaker = None
    if task == CUSTOM_VOICE:
        speakers = {name.lower(): name for name in info.speakers}
        if not req.voice:
            raise InvalidArgument(
                f"custom_voice needs a speaker (voice); available: {', '.join(sorted(speakers))}"
            )
        if req.voice.strip().lower() not in speakers:
            raise NotFound(
                f"unknown speaker {req.voice!r}; this model's speakers: {', '.join(sorted(speakers))}"
            )
        speaker = speakers[req.voice.strip().lower()]
    elif task == VOICE_DESIGN:
        if not req.instructions.strip():
            raise InvalidArgument("voice_design needs instructions describing the voice")
    elif task == VOICE_CLONE:
        if req.reference_pcm_f32:
            if len(req.reference_pcm_f32) % 4:
                raise InvalidArgument("reference_pcm_f32 must be float32 samples (a multiple of 4 bytes)")
            if not req.x_vector_only and not req.reference_text.strip():
                raise InvalidArgument(
                    "voice clone needs reference_text (the transcript) unless x_vector_only is set"
                )
        elif not req.voice:
            raise InvalidArgument("voice clone needs reference audio or a named voice")
    return CheckedRequest(task=task, language=language, speaker=speaker)


def check_limits(req: GenerationRequest) -> None:
    """Every field within `qtts.request_limits`, whatever the served model."""
    for value, param, max_chars in (
        (req.text, "text", lim.TEXT_MAX_CHARS),
        (req.voice, "voice", lim.VOICE_MAX_CHARS),
        (req.language, "language", lim.LANGUAGE_MAX_CHARS),
        (req.instructions, "instructions", lim.INSTRUCTIONS_MAX_CHARS),
        (req.reference_text, "reference_text", lim.REF_TEXT_MAX_CHARS),
        (req.request_id, "request_id", lim.DERIVED_REQUEST_ID_MAX_CHARS),
    ):
        lim.check_string(value, param, max_chars)
    lim.check_sampling(req.sampling)
    lim.check_chunking(req.first_chunk_frames, req.chunk_frames_ramp)
    if not 0 <= req.max_new_frames <= lim.MAX_FRAMES:
        raise InvalidArgument(f"max_new_frames must be in 0..{lim.MAX_FRAMES}", param="max_new_frames")
    pcm = req.reference_pcm_f32
    if pcm and len(pcm) % 4 == 0 and not np.isfinite(np.frombuffer(pcm, dtype="<f4")).all():
        raise InvalidArgument("reference_pcm_f32 holds non-finite samples", param="reference_pcm_f32")
