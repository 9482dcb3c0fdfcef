"""What the deadline scheduler's queue and running set predict: when a request submitted now
would start, whether it is refused at once (and the `Retry-After` it is told), and the requests
waiting past their first-audio budget.

Pure bookkeeping over a `DeadlineScheduler`'s state (its waiting queue, running streams and
admission); it changes nothing but the queue it refuses from.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from qtts.request.errors import ResourceExhausted, TTSError, Unavailable

from .scheduled import ScheduledRequest, length_frames

if TYPE_CHECKING:
    from .deadline import DeadlineScheduler, StepPlan


class QueueForecast:
    """The waits, refusals and retry hints of one scheduler's queue."""

    def __init__(self, scheduler: DeadlineScheduler):
        self._s = scheduler

    def refusal(self, now: float, ahead: int = 0) -> TTSError | None:
        """The error `submit` would refuse a request with now (None: it would queue), with `ahead`
        more requests before it that are not submitted yet (prompts still being built): so a
        request can be refused before its prompt is built, not after waiting behind the others."""
        s = self._s
        if not s.admitting:
            return Unavailable("the talker is draining and admits no new requests")
        queued = len(s.waiting) + ahead
        if len(s.running) + queued >= s.max_batch + s.max_waiting:
            return ResourceExhausted(
                f"the talker is at capacity ({s.max_batch} streams generating, "
                f"{s.max_waiting} waiting); retry later",
                self.retry_after(now, ahead),
            )
        adm = s.admission
        if adm is not None and adm.config.first_audio_budget_s > 0:
            wait = self.predicted_wait_s(now, ahead)
            if wait is not None and wait > adm.config.first_audio_budget_s:
                return ResourceExhausted(
                    f"the talker is at capacity: {queued} requests wait to start, about "
                    f"{wait:.1f} s, over the {adm.config.first_audio_budget_s:g} s first-audio budget",
                    self.retry_after(now, ahead),
                )
        return None

    def predicted_wait_s(self, now: float, ahead: int = 0) -> float | None:
        """How long a request submitted now would wait to start (None: no estimate, or at once),
        behind the waiting requests and `ahead` more not submitted yet.

        The later of two predictions: the queue's drain rate, and, when the running
        streams fill the capacity admission allows, the time until enough of them finish to let
        every request ahead and this one in (from each stream's expected length, paced at most
        `max_lead_s` ahead of its listener). At capacity the queue drains only as streams end, which
        a rate measured while it still admitted freely overestimates."""
        s = self._s
        adm = s.admission
        if adm is None:
            return None
        waits = []
        queued = len(s.waiting) + ahead
        if queued:
            rate_wait = adm.predicted_wait_s(queued, now, self.waiting_since())
            if rate_wait is not None:
                waits.append(rate_wait)
        cap = adm.capacity(self.mean_stream_s())
        if cap is not None:
            need = len(s.running) + queued + 1 - cap
            if need > 0:
                ends = sorted(self._finish_in_s(r, now) for r in s.running.values())
                end = ends[need - 1] if need <= len(ends) else math.inf
                if not math.isinf(end):  # streams of unknown length give no estimate
                    waits.append(end)
        return max(waits) if waits else None

    def mean_stream_s(self) -> float | None:
        """Mean expected length of the running streams and the next waiting one (None: unknown);
        O(1): the running streams' sum and count are kept by `RunningStreams`."""
        s = self._s
        total, n = s.running.length_frames, s.running.num_lengths
        if s.waiting and (frames := length_frames(s.waiting[0])):
            total, n = total + frames, n + 1
        return total * s.policy.frame_s / n if n else None

    def retry_after(self, now: float, ahead: int = 0) -> int | None:
        adm = self._s.admission
        if adm is None:
            return None
        return adm.retry_after_s(len(self._s.waiting) + ahead, now, self.waiting_since())

    def waiting_since(self) -> float | None:
        """When the oldest waiting request was submitted (None: none waits)."""
        waiting = self._s.waiting
        return waiting[0].submitted_at if waiting else None

    def refuse_expired(self, now: float, plan: StepPlan) -> None:
        """Refuse (into `plan`) the waiting requests past their first-audio budget."""
        s = self._s
        adm = s.admission
        if adm is None or adm.config.first_audio_budget_s <= 0:
            return
        budget = adm.config.first_audio_budget_s
        while s.waiting and now - s.waiting[0].submitted_at > budget:
            req = s.waiting.popleft()
            waited = now - req.submitted_at
            plan.refused.append(
                (
                    req,
                    ResourceExhausted(
                        f"the talker is at capacity: the request waited {waited:.1f} s to start, "
                        f"past the {budget:g} s first-audio budget; retry later",
                        self.retry_after(now),
                    ),
                )
            )

    def _length_s(self, req: ScheduledRequest) -> float | None:
        """A stream's expected length in seconds of audio (None: unknown)."""
        total = length_frames(req)
        return total * self._s.policy.frame_s if total else None

    def _finish_in_s(self, req: ScheduledRequest, now: float) -> float:
        """When a running stream is expected to end generating, from now."""
        length = self._length_s(req)
        if length is None:
            return math.inf
        played = 0.0 if req.first_audio_at is None else now - req.first_audio_at
        return max(0.0, length - played - self._s.policy.max_lead_s)
