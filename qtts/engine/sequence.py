"""Per-request state of the talker engine (host side only; tensors live in the model runner)."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # made, not yet added to the slot scheduler (no KV slot)
    PREFILLING = "prefilling"  # owns a slot, prompt KV partly written
    RUNNING = "running"  # prompt in KV, produces one frame per step
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its prompt, sampling settings and how far prefill and generation got.

    The prompt's last position is not prefilled: it is the first decode step's input, so every
    frame (the first included) comes out of the same batched decode step.
    """

    request_id: str
    prompt: Any  # qtts.model.TalkerPrompt (embeds [L,H], trailing [N,H], max_frames)
    sampling: Any  # qtts.model.SamplingParams
    seed: int
    max_frames: int
    cap_reason: str  # finish reason when max_frames is reached: "length" or "frame_cap"
    prefix_key: str | None = None
    prefix_len: int = 0
    status: SeqStatus = SeqStatus.WAITING
    slot: int = -1
    num_prefilled: int = 0  # prompt positions whose KV is in the slot
    num_frames: int = 0  # frames emitted so far (= talker decode steps taken)
    finish_reason: str | None = None
    # Text still arriving (a qtts.model.text_feed.TextFeed; None: a whole text), the caller's
    # own length bound (the bounds are set again from the whole text when the feed closes), and
    # the trailing positions and feed chunks in the runner so far.
    text_feed: Any = None
    max_new_frames: int | None = None
    num_trailing: int = 0
    chunks_taken: int = 0

    @property
    def waiting_for_text(self) -> bool:
        """The next frame's input needs trailing text that has not arrived."""
        return self.text_feed is not None and self.num_trailing <= self.num_frames

    @functools.cached_property
    def prompt_len(self) -> int:
        """Positions of the prompt (kept: the prompt does not change, and the engine reads this
        for every row every step, through `next_position` and `num_kv_positions`)."""
        return int(self.prompt.embeds.shape[0])

    @property
    def num_prefill_positions(self) -> int:
        """Positions written by prefill: all but the last prompt position."""
        return self.prompt_len - 1

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= self.num_prefill_positions

    @property
    def num_kv_positions(self) -> int:
        """Leading positions of the slot that hold this sequence's KV."""
        if self.status is SeqStatus.RUNNING:
            return self.num_prefill_positions + self.num_frames
        return self.num_prefilled

    @property
    def next_position(self) -> int:
        """Position of the next talker decode step."""
        return self.num_prefill_positions + self.num_frames

    @property
    def max_positions(self) -> int:
        """KV positions the sequence can need: the prompt plus one per frame and the EOS step."""
        return self.prompt_len + self.max_frames
