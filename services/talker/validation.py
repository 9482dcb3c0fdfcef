"""Checks a request against the served model before any work is done, with messages a client can act on."""

from __future__ import annotations

from typing import Any

import numpy as np

from qtts.request import request_limits as lim
from qtts.request import vocabulary
from qtts.request.errors import InvalidArgument
from qtts.request.vocabulary import TALKER_FIELDS, CheckedRequest
from qtts.streams.voice_key import is_reference_digest

from .request import GenerationRequest

__all__ = ["CheckedRequest", "check_request"]


def check_request(req: GenerationRequest, info: Any) -> CheckedRequest:
    """Validate `req` against `info` (a `qtts.model.ModelInfo`); raises InvalidArgument/NotFound.

    The gateway's checks (`qtts.request.vocabulary.check_request`), run again here: a direct caller must
    not be able to put a row into a batch that fails the shared sampling step."""
    if not 0 <= req.max_new_frames <= lim.MAX_FRAMES:
        raise InvalidArgument(f"max_new_frames must be in 0..{lim.MAX_FRAMES}", param="max_new_frames")
    pcm = req.reference_pcm_f32
    if pcm and len(pcm) % 4 == 0 and not np.isfinite(np.frombuffer(pcm, dtype="<f4")).all():
        raise InvalidArgument("reference_pcm_f32 holds non-finite samples", param="reference_pcm_f32")

    digest = req.reference_digest
    if digest and not is_reference_digest(digest):
        raise InvalidArgument(
            "reference_digest must be 64 lowercase hex digits (qtts.streams.voice_key.reference_digest)",
            param="reference_digest",
        )

    def check_pcm() -> None:
        if len(pcm) % 4:
            raise InvalidArgument(
                "reference_pcm_f32 must be float32 samples (a multiple of 4 bytes)", param="reference_pcm_f32"
            )

    return vocabulary.check_request(
        req, info, has_reference=bool(pcm or digest), check_reference=check_pcm, names=TALKER_FIELDS
    )
