"""Domain types of one talker request and what it yields (no protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtts.request.sampling_overrides import SamplingOverrides


@dataclass(frozen=True)
class GenerationRequest:
    """What the talker is asked to synthesise; `task=None` means the served model's task."""

    request_id: str
    text: str
    task: str | None = None
    voice: str = ""
    language: str = ""
    instructions: str = ""
    reference_pcm_f32: bytes = b""
    # qtts.streams.voice_key.reference_digest of a clip sent before, instead of the clip itself.
    reference_digest: str = ""
    reference_text: str = ""
    x_vector_only: bool = False
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    max_new_frames: int = 0
    first_chunk_frames: int = 0
    chunk_frames_ramp: tuple[int, ...] = ()
    streaming_text: bool | None = None
