"""Content key of a voice prompt: the same reference, transcript, mode and model give the same key.

The talker looks voice prompts up in speaker_cache by this key, so two requests (or two talker
replicas) cloning the same clip share one computed prompt.

The key is built in two steps: the *reference digest* covers what the client sent (the clip, its
transcript, the mode) and needs no model; the key adds the model. A gateway that already sent a
clip to the talkers sends only its digest the next time (talker.v1 `reference_digest`): the talker
finds the prompt by the key of that digest, or answers FAILED_PRECONDITION with
`REFERENCE_NOT_CACHED` and the gateway sends the clip. So a voice agent's clip crosses the
gateway-talker hop once, not with every request.
"""

from __future__ import annotations

import hashlib
import re

# Bump when the stored prompt's meaning changes, so old entries are never reused.
KEY_VERSION = "v2"

# The start of the talker's FAILED_PRECONDITION message for a digest it holds no prompt for: the
# gateway matches it and sends the request again with the clip.
REFERENCE_NOT_CACHED = "reference_digest is not cached here"

_DIGEST = re.compile("[0-9a-f]{64}")


def _update(h, part: bytes) -> None:
    # Length-prefix every field so that no two different tuples hash the same byte stream.
    h.update(len(part).to_bytes(8, "little"))
    h.update(part)


def reference_digest(reference_pcm_f32: bytes, reference_text: str | None, x_vector_only: bool) -> str:
    """sha256 hex over (version, mode, reference PCM bytes, reference text).

    `reference_pcm_f32` is the 24 kHz mono clip as float32 little-endian bytes. In x-vector-only
    mode the transcript does not enter the prompt, so it does not enter the digest either.
    """
    mode = "xvec" if x_vector_only else "icl"
    text = "" if x_vector_only else (reference_text or "")
    h = hashlib.sha256()
    for part in (KEY_VERSION.encode(), mode.encode(), reference_pcm_f32, text.encode("utf-8")):
        _update(h, part)
    return h.hexdigest()


def is_reference_digest(value: str) -> bool:
    """Whether `value` has the form of a `reference_digest` (64 lowercase hex digits)."""
    return _DIGEST.fullmatch(value) is not None


def voice_prompt_key_for_digest(model_id: str, digest: str) -> str:
    """The voice prompt key of a reference digest under `model_id`."""
    h = hashlib.sha256()
    for part in (KEY_VERSION.encode(), model_id.encode("utf-8"), digest.encode()):
        _update(h, part)
    return h.hexdigest()


def voice_prompt_key(
    model_id: str, reference_pcm_f32: bytes, reference_text: str | None, x_vector_only: bool
) -> str:
    """The voice prompt key of a clip: `voice_prompt_key_for_digest` of its `reference_digest`."""
    return voice_prompt_key_for_digest(
        model_id, reference_digest(reference_pcm_f32, reference_text, x_vector_only)
    )
