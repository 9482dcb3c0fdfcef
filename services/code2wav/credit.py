"""The credit policy of a decode stream: how far the producer may send frames.

    frames_allowed_until = min(decoded_frames + window_frames,
                               acked_frames + max_ahead_frames)

- `decoded_frames + window_frames` bounds the frames received but not yet decoded (the decode
  backlog) by `window_frames`: a slow decoder throttles the producer, and this server's memory per
  stream is bounded by the window.
- `acked_frames + max_ahead_frames` bounds the audio produced but not yet taken by the listener
  (`acked_frames` = samples acknowledged by the client / samples per frame): a slow reader stalls
  its own stream only.

Both terms only move forward, and a grant is sent only when the value moves. A chunk can only be
decoded once all its frames arrived, so every chunk size must be <= both bounds (the planner is
capped to `max_chunk_frames()`), otherwise a stream could wait forever for frames it may not send.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CreditPolicy:
    """Window sizes in frames; see the module docstring for the formula."""

    window_frames: int = 32
    max_ahead_frames: int = 100

    def __post_init__(self) -> None:
        if self.window_frames < 1 or self.max_ahead_frames < 1:
            raise ValueError("credit window and max-ahead must be >= 1 frame")

    def frames_allowed_until(self, decoded_frames: int, acked_frames: int) -> int:
        return min(decoded_frames + self.window_frames, acked_frames + self.max_ahead_frames)

    def max_chunk_frames(self) -> int:
        """The largest chunk that can always become ready under this policy."""
        return min(self.window_frames, self.max_ahead_frames)
