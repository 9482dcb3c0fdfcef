"""Qwen3-TTS-12Hz model core: talker side (prompt, talker LM, code predictor, sampling, eager
generator) and codec side (speech-tokenizer decoder/encoder, speaker encoder).

See docs/interfaces.md for the contract and docs/model.md for what each part is.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from qtts.model.bundle import TalkerBundle, load_talker_bundle
from qtts.model.config import ModelConfig, ModelInfo
from qtts.model.generator import EagerGenerator, StepOutput
from qtts.model.prompt import SynthesisSpec, TalkerPrompt, VoicePrompt
from qtts.model.sampling import SamplingParams
from qtts.model.snapshot import SnapshotError

# Codec-side names resolve lazily so the talker side imports without the codec modules' cost.
_LAZY = {
    "load_codec_decoder": "qtts.model.codec_decoder",
    "CodecDecoder": "qtts.model.codec_decoder",
    "IncrementalDecoder": "qtts.model.incremental",
    "DecoderState": "qtts.model.incremental",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qtts.model' has no attribute {name!r}")


__all__ = [
    "load_talker_bundle",
    "load_codec_decoder",
    "TalkerBundle",
    "CodecDecoder",
    "IncrementalDecoder",
    "DecoderState",
    "SynthesisSpec",
    "VoicePrompt",
    "TalkerPrompt",
    "SamplingParams",
    "EagerGenerator",
    "StepOutput",
    "SnapshotError",
    "ModelInfo",
    "ModelConfig",
]
