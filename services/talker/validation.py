"""Checks a request against the served model before any work is done, with messages a client can act on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qtts.errors import InvalidArgument, NotFound

from .request import CUSTOM_VOICE, TASK_OF_MODEL_TYPE, VOICE_CLONE, VOICE_DESIGN, GenerationRequest


@dataclass(frozen=True)
class CheckedRequest:
    """The task, language and speaker a request resolves to on the served model."""

    task: str
    language: str
    speaker: str | None


def check_request(req: GenerationRequest, info: Any) -> CheckedRequest:
    """Validate `req` against `info` (a `qtts.model.ModelInfo`); raises InvalidArgument/NotFound."""
    if not req.text.strip():
        raise InvalidArgument("text is empty")
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
    if req.max_new_frames < 0:
        raise InvalidArgument("max_new_frames must be >= 0")
    return CheckedRequest(task=task, language=language, speaker=speaker)
