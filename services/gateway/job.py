"""Protocol-neutral request and result types of the gateway (no protobuf, no HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qtts.request.sampling_overrides import SamplingOverrides
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE, SAMPLES_PER_FRAME, Task, served_task


@dataclass(frozen=True)
class ModelCatalog:
    """What the served model offers, from the talker's GetModelInfo."""

    name: str
    model_type: str
    model_size: str = ""
    speakers: tuple[str, ...] = ()
    languages: tuple[str, ...] = ()
    sample_rate: int = NATIVE_SAMPLE_RATE
    samples_per_frame: int = SAMPLES_PER_FRAME

    @property
    def task(self) -> str:
        return served_task(self.model_type) or Task.VOICE_CLONE.value


# The gateway's name for the shared per-request sampling overrides.
SamplingOptions = SamplingOverrides


@dataclass(frozen=True)
class SpeechFields:
    """A synthesis request as the client sent it, before validation: the one typed request every
    transport (HTTP, WebSocket, gRPC, batch) converts its input to and hands to
    `GatewayCore.validate`.

    `text` None: a streamed session's configuration, checked before its text comes (each segment
    is then a request of its own, with its text). `text_follows`: more text is appended while the
    request runs (text_stream.py), so the text is kept as received, its trailing space too."""

    text: str | None
    model: str = ""
    task: str | None = None
    voice: str | None = None
    language: str | None = None
    instructions: str | None = None
    # Encoded reference clip (wav, flac, mp3, ...), already base64-decoded.
    reference_audio: bytes | None = None
    reference_text: str | None = None
    x_vector_only: bool = False
    max_new_frames: int | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    sample_rate: int | None = None
    request_id: str = ""
    # Chunking in frames (0 / empty = the talker's defaults).
    first_chunk_frames: int = 0
    chunk_frames_ramp: tuple[int, ...] = ()
    # Feed the text one token per frame (True) or all up front (False); None = the talker's default.
    streaming_text: bool | None = None
    text_follows: bool = False


@dataclass(frozen=True)
class SynthesisJob:
    """A validated request, ready for the talker."""

    request_id: str
    text: str
    task: str
    voice: str
    language: str
    instructions: str
    reference_audio: bytes | None
    reference_text: str
    x_vector_only: bool
    max_new_frames: int
    sampling: SamplingOptions
    sample_rate: int
    first_chunk_frames: int = 0
    chunk_frames_ramp: tuple[int, ...] = ()
    streaming_text: bool | None = None
    # Decoded reference clip (float32 mono, 24 kHz), filled in by the gateway core.
    reference_pcm: np.ndarray | None = None
    # Request fields the served variant cannot honour, dropped and reported to the client
    # (instructions.py: only under --unsupported-instructions ignore).
    ignored_fields: tuple[str, ...] = ()
