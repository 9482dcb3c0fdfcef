"""What each Qwen3-TTS model variant accepts, without loading one (shared by talker and gateway)."""

from __future__ import annotations

from qtts.request.errors import InvalidArgument


def supports_instructions(model_type: str, model_size: str) -> bool:
    """Whether the variant's prompt takes an instruct block: VoiceDesign (which needs one) and
    CustomVoice except 0.6B, whose instruct the official wrapper drops (`tts_model_size in "0b6"`,
    kept as written); Base (voice clone) never does."""
    if model_type == "base":
        return False
    return not (model_type == "custom_voice" and model_size in "0b6")


def unsupported_instructions(name: str, model_type: str, model_size: str) -> InvalidArgument:
    """The refusal of `instructions` sent to a variant whose prompt has no instruct block."""
    size = f" {model_size}" if model_size else ""
    return InvalidArgument(
        f"instructions are not supported by {name} ({model_type}{size}): only VoiceDesign "
        "and 1.7B CustomVoice models take them; leave the field out (a gateway started with "
        "--unsupported-instructions ignore drops it and reports it in the x-tts-ignored-fields header)",
        param="instructions",
    )
