"""Which requests the generator holds, which wait, and which may step: pure bookkeeping, no torch.

A request runs ahead of the credit code2wav granted by at most `window` frames: those frames wait
in the request's send buffer, so the talker's memory per stream is bounded by the window, and a
stream whose decoder or listener is slow stops generating (it is skipped) without holding up others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qtts.errors import ResourceExhausted, Unavailable

from .admission import RealtimeGuard


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
    """

    request_id: str
    prompt: Any
    sampling: Any
    max_new_frames: int | None
    credit: StreamCredit
    sink: Callable[[Any], None]
    submitted_at: float = 0.0
    stalled: bool = False
    stepped: bool = False
    loop: Any = None
    # Written by the asyncio side as audio is handed on (the guard's delivery lead).
    first_audio_at: float | None = None
    delivered_s: float = 0.0


class Scheduler:
    """Waiting queue (bounded) and running set (bounded by the generator's batch and, with a
    `guard`, by what keeps the running streams real-time)."""

    def __init__(self, max_batch: int, max_waiting: int, guard: RealtimeGuard | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: dict[str, ScheduledRequest] = {}
        self.admitting = True
        self.guard = guard

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def submit(self, req: ScheduledRequest) -> None:
        """Queue a request; it runs when a generator slot is free.

        Raises Unavailable while draining and ResourceExhausted when the waiting queue is full.
        """
        if not self.admitting:
            raise Unavailable("the talker is draining and admits no new requests")
        if req.request_id in self.running or any(w.request_id == req.request_id for w in self.waiting):
            raise ResourceExhausted(f"request id {req.request_id!r} is already in progress")
        if len(self.running) + len(self.waiting) >= self.max_batch + self.max_waiting:
            raise ResourceExhausted(
                f"the talker is at capacity ({self.max_batch} streams generating, "
                f"{self.max_waiting} waiting); retry later"
            )
        self.waiting.append(req)

    def admit(self) -> list[ScheduledRequest]:
        """Move waiting requests into the running set, first come first served, up to max_batch
        (and, with a guard, only while it allows, at most its per-step number at a time)."""
        if not self.can_admit():
            return []
        limit = self.max_batch
        if self.guard is not None:  # a burst ramps up, so the guard's signals can react
            limit = min(limit, len(self.running) + self.guard.config.max_admit_per_step)
        admitted = []
        while self.waiting and len(self.running) < limit:
            req = self.waiting.popleft()
            self.running[req.request_id] = req
            admitted.append(req)
        return admitted

    def skip_set(self) -> set[str]:
        """Running requests without credit: the next step must not advance them."""
        return {rid for rid, req in self.running.items() if not req.credit.has_credit()}

    def has_steppable(self) -> bool:
        return any(req.credit.has_credit() for req in self.running.values())

    def can_admit(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_batch:
            return False
        return self.guard is None or self.guard.allows(self.running.values())

    def remove(self, request_id: str) -> tuple[ScheduledRequest | None, bool]:
        """Forget a request; returns it and whether it was running (so the generator holds it)."""
        req = self.running.pop(request_id, None)
        if req is not None:
            return req, True
        for w in self.waiting:
            if w.request_id == request_id:
                self.waiting.remove(w)
                return w, False
        return None, False
