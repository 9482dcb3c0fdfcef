"""What the scheduler knows of each request: its credit, its playback clock and chunk plan, and the
running set with the sum of its known lengths.

Written by two sides: the asyncio side moves the playback clock and the credit grants, the engine
thread the frames generated; the deadline scheduler (`deadline.py`) reads both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FRAME_S = 0.08  # one codec frame: 1920 samples at 24 kHz


@dataclass
class StreamCredit:
    """Credit of one stream, in generated-frame indices.

    `granted_until` is code2wav's latest `frames_allowed_until` (written by the asyncio side),
    `generated` the frames produced so far (written by the engine thread).
    """

    window: int
    granted_until: int = 0
    generated: int = 0

    def has_credit(self) -> bool:
        return self.generated < self.granted_until + self.window

    def grant(self, frames_allowed_until: int) -> bool:
        """Record a grant; grants never move backwards. True when the credit grew."""
        if frames_allowed_until > self.granted_until:
            self.granted_until = frames_allowed_until
            return True
        return False


@dataclass
class ScheduledRequest:
    """A request on its way through the generator; `sink` receives its engine events.

    With `loop` set, `sink` runs on that event loop (the engine batches one step's events into one
    `call_soon_threadsafe`); without it, `sink` is called on the engine thread and must be
    thread-safe.

    The playback clock (`first_audio_at`, `delivered_s`) is written by the asyncio side as audio
    is handed on; the scheduler reads it (a float store is atomic under the GIL).
    """

    request_id: str
    prompt: Any
    sampling: Any
    max_new_frames: int | None
    credit: StreamCredit
    sink: Callable[[Any], None]
    submitted_at: float = 0.0
    admitted_at: float = 0.0
    stalled: bool = False
    stepped: bool = False
    loop: Any = None
    first_audio_at: float | None = None
    delivered_s: float = 0.0
    # code2wav's chunk plan for this stream (a qtts.streams.chunk_plan.ChunkPlan, from its first grant):
    # audio reaches the listener a whole chunk at a time.
    chunk_plan: Any = None
    # Whether that replica cuts its chunks at a flush (its first grant says so): a stream whose
    # text runs dry short of a boundary is then flushed, and the plan cut there.
    cuts_at_flush: bool = False
    # Frames generated and not yet handed to the event loop (engine thread only).
    held_codes: list = field(default_factory=list)
    # Text still arriving (qtts.model.text_feed.TextFeed; None: the whole text is in the prompt).
    text: Any = None
    # Skipped for lack of text in the last plan; and, once the text came back after the
    # listener ran dry, the playback clock restarts at the next chunk handed on.
    text_waiting: bool = False
    clock_restart: bool = False
    # The next chunk boundary above `_next_end_from` frames of `_next_end_plan` (engine thread
    # only): the same for every count of frames up to it, so the scheduler's per-stream pass does
    # not walk the plan's ramp every plan (`frames_to_next_chunk`).
    _next_end: int = field(default=0, repr=False, compare=False)
    _next_end_from: int = field(default=0, repr=False, compare=False)
    _next_end_plan: Any = field(default=None, repr=False, compare=False)

    @property
    def clock_running(self) -> bool:
        """Whether the listener is playing: audio was handed on and the clock is not paused."""
        return self.first_audio_at is not None and not self.clock_restart

    def hand_on_now(self) -> bool:
        """Whether the frames held so far go to the event loop now: at a chunk boundary, when the
        credit stops the stream, or while the chunk plan is unknown (frame by frame). A stream
        whose text is still arriving goes frame by frame too: its text may run dry short of a
        boundary, and the event loop then sends code2wav what there is (`waits_for_text`)."""
        plan = self.chunk_plan
        if plan is None or self.text is not None:
            return True
        generated = self.credit.generated
        # On a boundary (`plan.end_at_or_below(generated) == generated`): the plan's start, or the
        # next boundary above the frame before is this one.
        on_boundary = generated == plan.start or (
            generated > plan.start and self._chunk_end_after(plan, generated - 1) == generated
        )
        return on_boundary or not self.credit.has_credit()

    def waits_for_text(self) -> bool:
        """Whether the next frame needs text that has not arrived."""
        return self.text is not None and not self.text.ready(self.credit.generated)

    @property
    def prefill_positions(self) -> int:
        embeds = getattr(self.prompt, "embeds", None)
        return int(embeds.shape[0]) if embeds is not None else 0

    def lead_s(self, now: float, frame_s: float = FRAME_S) -> float:
        """Audio generated ahead of the listener's playback; -inf before the first audio."""
        if not self.clock_running:
            return -math.inf
        return self.credit.generated * frame_s - (now - self.first_audio_at)

    def slack_s(self, now: float) -> float:
        """Audio handed on ahead of the listener's playback (what it has buffered)."""
        if not self.clock_running:
            return math.inf
        return self.delivered_s - (now - self.first_audio_at)

    def frames_to_next_chunk(self) -> int:
        """Frames still to generate before the stream's next chunk can be handed on."""
        plan = self.chunk_plan
        if plan is None:
            return 1
        generated = self.credit.generated
        return self._chunk_end_after(plan, generated) - generated

    def _chunk_end_after(self, plan: Any, frames: int) -> int:
        """`plan.end_after(frames)`, kept for every count of frames below it: one walk of the plan
        a chunk, where the scheduler's pass and the hand-on check ask every step."""
        end = self._next_end
        if plan is not self._next_end_plan or not self._next_end_from <= frames < end:
            end = self._next_end = plan.end_after(frames)
            self._next_end_from, self._next_end_plan = frames, plan
        return end

    def playing_slack_s(self, now: float, step_s: float) -> tuple[float, float]:
        """(`slack_s`, time left) of a stream whose clock runs (`clock_running`), in one pass: the
        scheduler's per-stream work every plan. The time left is the slack once the frames of its
        next chunk are generated at `step_s` a frame: how long a step may be delayed before this
        stream's listener runs dry."""
        slack = self.delivered_s - (now - self.first_audio_at)
        if self.chunk_plan is None:
            return slack, slack
        return slack, slack - self.frames_to_next_chunk() * step_s


def length_frames(req: ScheduledRequest) -> Any:
    """A stream's expected length in frames (0 or None: unknown)."""
    return (
        req.max_new_frames
        or getattr(req.prompt, "default_max_frames", None)
        or getattr(req.prompt, "max_frames", None)
    )


class RunningStreams(dict[str, ScheduledRequest]):
    """The running streams by request id, with the sum and count of their known lengths (frames)
    kept as streams come and go, so the mean length costs O(1) per plan and submit instead of a
    scan of every stream. A stream's length is taken when it is added (its `max_new_frames` and
    prompt do not change while it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self._frames: dict[str, Any] = {}  # the known lengths, by request id
        self.length_frames: Any = 0  # their sum
        self.num_lengths = 0  # their count

    def __setitem__(self, rid: str, req: ScheduledRequest) -> None:
        self._forget(rid)
        super().__setitem__(rid, req)
        frames = length_frames(req)
        if frames:
            self._frames[rid] = frames
            self.length_frames += frames
            self.num_lengths += 1

    def __delitem__(self, rid: str) -> None:
        super().__delitem__(rid)
        self._forget(rid)

    def pop(self, rid: str, *default: Any) -> Any:
        if rid not in self:
            return super().pop(rid, *default)
        self._forget(rid)
        return super().pop(rid)

    def popitem(self) -> tuple[str, ScheduledRequest]:
        rid, req = super().popitem()
        self._forget(rid)
        return rid, req

    def setdefault(self, rid: str, req: Any = None) -> Any:
        if rid not in self:
            self[rid] = req
        return self[rid]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for rid, req in dict(*args, **kwargs).items():
            self[rid] = req

    def __ior__(self, other: Any) -> RunningStreams:
        self.update(other)
        return self

    def clear(self) -> None:
        super().clear()
        self._frames.clear()
        self.length_frames, self.num_lengths = 0, 0

    def _forget(self, rid: str) -> None:
        frames = self._frames.pop(rid, None)
        if frames is not None:
            self.length_frames -= frames
            self.num_lengths -= 1
