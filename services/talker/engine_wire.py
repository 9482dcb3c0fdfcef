"""What crosses the pipes between the talker's front and its engine process, besides commands:
the engine's facts, the handle of a prompt built there, and voice prompts and synthesis specs with
numpy arrays instead of tensors (see engine_process.py for the protocol)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


@dataclass(frozen=True)
class EngineFacts:
    """What the front needs of the loaded model, sent once the engine process is ready."""

    info: Any
    generation_defaults: Any
    voice_fingerprint: str
    max_text_positions: int | None
    pid: int
    # Seconds each phase of the engine process's start-up took (load, graph capture, warm-up).
    startup: dict[str, float] = field(default_factory=dict)


@dataclass
class RemotePrompt:
    """A prompt built and held in the engine process; `ref_codes_host` are its ICL reference
    frames as int16 rows (None without), `num_text_tokens` its target text's tokens."""

    key: str
    ref_codes_host: np.ndarray | None
    num_text_tokens: int
    build_s: float = 0.0  # the engine process's moving average of one build, as this one was done


def voice_to_wire(voice: Any) -> Any:
    """A VoicePrompt with numpy arrays instead of tensors: a tensor pickles through torch.save,
    an array as its bytes."""
    if voice is None:
        return None
    arrays = {n: t.numpy() for n in ("x_vector", "ref_codes") if (t := getattr(voice, n, None)) is not None}
    return replace(voice, **arrays)


def voice_from_wire(voice: Any) -> Any:
    if voice is None:
        return None
    import torch

    tensors = {
        n: torch.from_numpy(a)
        for n in ("x_vector", "ref_codes")
        if isinstance(a := getattr(voice, n, None), np.ndarray)
    }
    return replace(voice, **tensors)


def spec_to_wire(spec: Any) -> Any:
    voice = getattr(spec, "voice_prompt", None)
    return spec if voice is None else replace(spec, voice_prompt=voice_to_wire(voice))


def spec_from_wire(spec: Any) -> Any:
    voice = getattr(spec, "voice_prompt", None)
    return spec if voice is None else replace(spec, voice_prompt=voice_from_wire(voice))
