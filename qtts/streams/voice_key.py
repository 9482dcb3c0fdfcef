"""Content key of a voice prompt: the same reference, transcript, mode and model give the same key.

The talker looks voice prompts up in speaker_cache by this key, so two requests (or two talker
replicas) cloning the same clip share one computed prompt.
"""

from __future__ import annotations

import hashlib

# Bump when the stored prompt's meaning changes, so old entries are never reused.
KEY_VERSION = "v1"


def voice_prompt_key(
    model_id: str, reference_pcm_f32: bytes, reference_text: str | None, x_vector_only: bool
) -> str:
    """sha256 hex over (version, model id, reference PCM bytes, reference text, mode).

    `reference_pcm_f32` is the 24 kHz mono clip as float32 little-endian bytes. In x-vector-only
    mode the transcript does not enter the prompt, so it does not enter the key either.
    """
    mode = "xvec" if x_vector_only else "icl"
    text = "" if x_vector_only else (reference_text or "")
    h = hashlib.sha256()
    for part in (KEY_VERSION.encode(), model_id.encode("utf-8"), mode.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    # Length-prefix every field so that no two different tuples hash the same byte stream.
    h.update(len(reference_pcm_f32).to_bytes(8, "little"))
    h.update(reference_pcm_f32)
    encoded = text.encode("utf-8")
    h.update(len(encoded).to_bytes(8, "little"))
    h.update(encoded)
    return h.hexdigest()
