"""`talker_job`: a validated gateway job, for the tests that drive a talker through the gateway's
talker client (fake talkers, the stage servers, the talker pool)."""

from __future__ import annotations

from typing import Any

from services.gateway.job import SamplingOptions, SynthesisJob


def talker_job(request_id: str, **fields: Any) -> SynthesisJob:
    """A 4-frame English custom-voice job for "vivian", with `fields` (SynthesisJob's) changed."""
    defaults: dict[str, Any] = {
        "text": "Hi.",
        "task": "custom_voice",
        "voice": "vivian",
        "language": "english",
        "instructions": "",
        "reference_audio": None,
        "reference_text": "",
        "x_vector_only": False,
        "max_new_frames": 4,
        "sampling": SamplingOptions(),
        "sample_rate": 24000,
    }
    return SynthesisJob(request_id=request_id, **{**defaults, **fields})
