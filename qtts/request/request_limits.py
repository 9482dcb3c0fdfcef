"""The finite range of every per-request field, declared once and enforced at every edge.

The gateway's typed HTTP/WebSocket model (`services.gateway.http_request`) declares its fields
with these bounds, and the one request pass (`qtts.request.vocabulary.check_request`, which the
gateway runs for every transport and the talker runs again) calls the functions below, so a
direct talker caller meets the same limits as a client of the gateway. The sampling
fields' declarations (`qtts.request.sampling_overrides.SamplingOverrides`) cite the sampling
constants, and `sampling_overrides.check_sampling` checks them from there. Sampling runs
batched: one row with a temperature of 1e-45 or 3.5e38 would turn the shared step's logits into
inf/NaN and fail every stream batched with it, so the ranges are narrow enough that no row can.

Messages name the public API's field (`param`): `min_new_tokens`, as HTTP spells it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from qtts.request.errors import InvalidArgument

# Sampling. A temperature of 0 means greedy decoding; otherwise it lies in [MIN, MAX].
TEMPERATURE_MIN, TEMPERATURE_MAX = 1e-3, 10.0
TOP_K_MAX = 100_000  # above the codebook size it means "all"; 0 disables it
TOP_P_MIN, TOP_P_MAX = 1e-3, 1.0
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.1, 10.0
SEED_MAX = 2**63 - 1
# Frames (80 ms each): 65,536 frames are 87 minutes of audio, far above any server's cap.
MAX_FRAMES = 65_536
# Chunking: code2wav caps a chunk at its credit window anyway.
MAX_CHUNK_FRAMES = 4096
MAX_CHUNK_RAMP_LEN = 32

# Text and names, in characters. The gateway's --max-input-chars is at most TEXT_MAX_CHARS.
TEXT_MAX_CHARS = 16_384
INSTRUCTIONS_MAX_CHARS = 4096
REF_TEXT_MAX_CHARS = 4096
VOICE_MAX_CHARS = 128
REQUEST_ID_MAX_CHARS = 128
# A request id the gateway derives (`<id>-<segment>` for streamed text) may be a little longer.
DERIVED_REQUEST_ID_MAX_CHARS = REQUEST_ID_MAX_CHARS + 16
MODEL_MAX_CHARS = 256
LANGUAGE_MAX_CHARS = 64
TASK_MAX_CHARS = 32
SPEAKER_EMBEDDING_MAX_VALUES = 8192

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_chunking(first_chunk_frames: int, ramp: Sequence[int]) -> None:
    """The first chunk in 0..MAX_CHUNK_FRAMES (0: the default) and a short ramp of 1..MAX frames."""
    if not 0 <= first_chunk_frames <= MAX_CHUNK_FRAMES:
        raise InvalidArgument(
            f"first_chunk_frames must be in 0..{MAX_CHUNK_FRAMES}, got {first_chunk_frames}",
            param="first_chunk_frames",
        )
    if len(ramp) > MAX_CHUNK_RAMP_LEN:
        raise InvalidArgument(
            f"chunk_frames_ramp has {len(ramp)} values; the limit is {MAX_CHUNK_RAMP_LEN}",
            param="chunk_frames_ramp",
        )
    if any(not 1 <= f <= MAX_CHUNK_FRAMES for f in ramp):
        raise InvalidArgument(
            f"chunk_frames_ramp values must be in 1..{MAX_CHUNK_FRAMES}", param="chunk_frames_ramp"
        )


def check_string(value: str | None, param: str, max_chars: int) -> None:
    """At most `max_chars` characters and no lone UTF-16 surrogate (it has no UTF-8 encoding)."""
    if not value:
        return
    if len(value) > max_chars:
        raise InvalidArgument(
            f"{param} is {len(value)} characters long; the limit is {max_chars}", param=param
        )
    if has_surrogate(value):
        raise InvalidArgument(
            f"{param} contains a lone UTF-16 surrogate (not valid Unicode text)", param=param
        )


def has_surrogate(value: str) -> bool:
    # str.isascii() reads a flag of the string object (O(1)): a base64 reference clip of a few
    # hundred KB, ASCII by construction, skips the scan that took 4% of the gateway's time in a
    # burst of voice-clone requests (py-spy, BENCHMARKS.md tenth H200 session).
    return not value.isascii() and _SURROGATE.search(value) is not None


def has_speakable_text(text: str) -> bool:
    """False for text made only of whitespace, control and format characters (nothing to say)."""
    return any(not ch.isspace() and unicodedata.category(ch)[0] != "C" for ch in text)
