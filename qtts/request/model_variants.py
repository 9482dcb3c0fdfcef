"""What each Qwen3-TTS model variant accepts, without loading one (shared by talker and gateway)."""

from __future__ import annotations


def supports_instructions(model_type: str, model_size: str) -> bool:
    """Whether the variant's prompt takes an instruct block: VoiceDesign (which needs one) and
    CustomVoice except 0.6B, whose instruct the official wrapper drops (`tts_model_size in "0b6"`,
    kept as written); Base (voice clone) never does."""
    if model_type == "base":
        return False
    return not (model_type == "custom_voice" and model_size in "0b6")
