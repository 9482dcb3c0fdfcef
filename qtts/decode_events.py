"""What one code2wav Decode stream says back, as domain events on both ends of the stream.

code2wav's servicer turns these into `code2wav.v1.DecodeResponse` messages and the talker's client
turns the messages back into them, so neither side's core imports the protobuf modules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Credit:
    """Permission to send frames up to (excluding) `frames_allowed_until`. The stream's first grant
    also carries the server's chunk plan (`first_chunk_frames` > 0, then `chunk_frames_ramp`, the
    last value repeating); later grants leave them 0 / empty."""

    frames_allowed_until: int
    first_chunk_frames: int = 0
    chunk_frames_ramp: tuple[int, ...] = ()

    def chunk_end_after(self, frames: int) -> int | None:
        """The first chunk boundary above `frames` under this grant's plan (None without a plan)."""
        if self.first_chunk_frames <= 0 or not self.chunk_frames_ramp:
            return None
        end, i = self.first_chunk_frames, 0
        while end <= frames:
            end += self.chunk_frames_ramp[min(i, len(self.chunk_frames_ramp) - 1)]
            i += 1
        return end


@dataclass(frozen=True)
class DecodedAudio:
    """PCM s16le of frames [first_frame_index, first_frame_index + num_frames)."""

    pcm_s16le: bytes
    num_samples: int
    first_frame_index: int
    num_frames: int
    decode_ns: int


@dataclass(frozen=True)
class Done:
    """The stream's last event: every frame decoded and sent."""

    num_frames: int
    num_samples: int
    replica: str


DecodeEvent = Credit | DecodedAudio | Done
