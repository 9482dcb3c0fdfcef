"""Shared code of the Qwen3-TTS serving stack: model core, audio helpers, generated stubs, errors."""
