"""What one code2wav Decode stream says back, as domain events on both ends of the stream.

code2wav's servicer turns these into `code2wav.v1.DecodeResponse` messages and the talker's client
turns the messages back into them, so neither side's core imports the protobuf modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtts.streams.chunk_plan import ChunkPlan


@dataclass(frozen=True)
class Credit:
    """Permission to send frames up to (excluding) `frames_allowed_until`. The stream's first grant
    also carries the chunk plan the server decodes it with; later grants carry None."""

    frames_allowed_until: int
    plan: ChunkPlan | None = None
    # With the plan: the server decodes at a flush (FrameDelta.flush cuts its chunks there).
    cuts_at_flush: bool = False


@dataclass(frozen=True)
class DecodedAudio:
    """PCM s16le of frames [first_frame_index, first_frame_index + num_frames)."""

    pcm_s16le: bytes
    num_samples: int
    first_frame_index: int
    num_frames: int
    decode_ns: int
    # How long the replica held the chunk: all its frames there to its audio out (AudioOut.held_ns).
    held_ns: int = 0
    # When the talker read it off its call (time.perf_counter; 0: not stamped): from then on, its
    # wait is the talker's own loop (tts_talker_code2wav_audio_queued_seconds).
    received_at: float = 0.0


@dataclass(frozen=True)
class Done:
    """The stream's last event: every frame decoded and sent."""

    num_frames: int
    num_samples: int
    replica: str


DecodeEvent = Credit | DecodedAudio | Done
