"""What the deadline scheduler's queue and running set predict: when a request submitted now
would start, whether it is refused at once (and the `Retry-After` it is told), and the requests
waiting past their first-audio budget.

Pure bookkeeping over a `DeadlineScheduler`'s state (its waiting queue, running streams and
admission); it changes nothing but the queue it refuses from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtts.request.errors import ResourceExhausted, TTSError, Unavailable

from .scheduled import ScheduledRequest, length_frames

if TYPE_CHECKING:
    from .deadline import DeadlineScheduler, StepPlan


@dataclass(frozen=True)
class Headroom:
    """A talker's room for new requests, published to the front ends (`QueueForecast.headroom`)."""

    start_now: int  # requests that would start at once
    accept: int  # requests that would be accepted (started, or queued within their budget)
    retry_after_s: int  # for a request refused now (0 while some are accepted)
    running: int
    waiting: int  # requests waiting to start, the ones whose prompts are being built included


# The running streams' expected ends, sorted, are reused for this long after they were worked out
# (until the running set changes or the scheduler's next plan): between, they are the same
# instants seen from a later now. Worked out per call, every request a busy talker refused at once
# sorted all its streams while holding the engine's lock: at 768 streams, a tenth of the event
# loop's busy time (py-spy, benchmarks/talker_host.py; benchmarks/HISTORY.md).
ENDS_REUSE_S = 0.05


class QueueForecast:
    """The waits, refusals and retry hints of one scheduler's queue."""

    def __init__(self, scheduler: DeadlineScheduler):
        self._s = scheduler
        # (when, the ends as instants, soonest first) of the last `_ends`; None: work them out.
        self._ends_at: tuple[float, list[float]] | None = None

    def streams_changed(self) -> None:
        """The running streams changed: the next `_ends` works them out afresh."""
        self._ends_at = None

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
        return self._late(now, ahead, self.predicted_wait_s(now, ahead))

    def _late(self, now: float, ahead: int, wait: float | None) -> TTSError | None:
        """The refusal of a new request that would wait `wait` to start: past the share of its
        first-audio budget a new request may be predicted to wait (`queue_budget_share`)."""
        adm = self._s.admission
        if adm is None or adm.config.first_audio_budget_s <= 0 or wait is None:
            return None
        budget = adm.config.first_audio_budget_s
        limit = budget * adm.config.queue_budget_share
        if wait <= limit:
            return None
        queued = len(self._s.waiting) + ahead
        return ResourceExhausted(
            f"the talker is at capacity: {queued} requests wait to start, about {wait:.1f} s, "
            f"over the {limit:g} s a new request may wait of its {budget:g} s first-audio budget",
            self.retry_after(now, ahead, wait),
        )

    def headroom(self, now: float, ahead: int = 0) -> Headroom:
        """What this talker may take now, for the front ends that pick among talkers: the streams
        that could start at once, the requests it would accept (start or queue within their
        first-audio budget), and how long a refused one should wait before retrying."""
        s = self._s
        queued = len(s.waiting) + ahead
        slots = s.max_batch + s.max_waiting - len(s.running) - queued
        if not s.admitting or slots <= 0:
            return Headroom(0, 0, self.retry_after(now, ahead) or 1, len(s.running), queued)
        cap = self.capacity()
        start_now = max(0, min(cap - len(s.running) - queued, slots))
        ends = self._ends(now)
        # The most k for which a request with k more ahead is still accepted (refusal is monotone
        # in the requests ahead): a binary search over the running streams' ends computed once.
        lo, hi = 0, slots
        if self._late(now, ahead, self.predicted_wait_s(now, ahead, ends)) is not None:
            hi = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._late(now, ahead + mid - 1, self.predicted_wait_s(now, ahead + mid - 1, ends)) is None:
                lo = mid
            else:
                hi = mid - 1
        # Not floored at start_now: a request's own check (`refusal`) counts the requests ahead of
        # it at the queue's drain rate even while slots are free, so a burst past that rate is
        # refused there; published as room, it was let in by the gateways and refused by this
        # talker, taken late, 1-2 s after it was sent.
        accept = lo
        retry = 0 if accept else (self.retry_after(now, ahead) or 1)
        return Headroom(start_now, accept, retry, len(s.running), queued)

    def capacity(self) -> int:
        """The most streams that may run at once: the scheduler's slots (`max_batch`, the
        engine's KV slots when they are fewer than `--max-batch`), or fewer where admission's
        duty and load bounds say so. Past it the queue drains only as streams end. With the load
        bound alone, an H100 (667 KV slots, admission's capacity 768-896) queued a closed loop's
        burst on the drain rate measured while slots were free, and refused 151 of its requests
        after they had waited 5.7 s of their 6 s first-audio budget (HISTORY.md, third session of
        2026-12-06)."""
        s = self._s
        cap = s.max_batch
        if s.admission is not None:
            cap = min(cap, s.admission.capacity(self.mean_stream_s()) or cap)
        return cap

    def predicted_wait_s(self, now: float, ahead: int = 0, ends: list[float] | None = None) -> float | None:
        """How long a request submitted now would wait to start (None: no estimate, or at once),
        behind the waiting requests and `ahead` more not submitted yet.

        The later of two predictions: the queue's drain rate, and, when the running streams fill
        the capacity (`capacity`: the slots, or what admission allows), the time until enough of
        them finish to let every request ahead and this one in (from each stream's expected
        length, paced at most `max_lead_s` ahead of its listener). At capacity the queue drains
        only as streams end, which a rate measured while it still admitted freely overestimates.
        `ends`: `_ends(now)`, when the caller already has them."""
        return self.wait_at(now, len(self._s.waiting) + ahead, ends)

    def wait_at(
        self, now: float, position: int, ends: list[float] | None = None, stalled: bool = True
    ) -> float | None:
        """How long a request with `position` requests ahead of it waits to start from now (see
        `predicted_wait_s`); `stalled` False: at the measured drain rate, however long since the
        last admission."""
        s = self._s
        adm = s.admission
        if adm is None:
            return None
        waits = []
        queued = position
        if queued:
            rate_wait = adm.predicted_wait_s(queued, now, self.waiting_since() if stalled else None)
            if rate_wait is not None:
                waits.append(rate_wait)
        cap = self.capacity()
        need = len(s.running) + queued + 1 - cap
        if need > 0:
            ends = self._ends(now) if ends is None else ends
            if need <= len(ends):
                end = ends[need - 1]
            else:  # more than every running stream must end: rounds of the streams after them
                mean_s = self.mean_stream_s() or adm.config.default_stream_s
                end = (ends[-1] if ends else 0.0) + mean_s * math.ceil((need - len(ends)) / max(cap, 1))
            if not math.isinf(end):  # streams of unknown length give no estimate
                waits.append(end)
        return max(waits) if waits else None

    # Streams of the configured default length (AdmissionConfig.default_stream_s) that the mean
    # length counts beside the known ones: a few short streams on an idle talker (a probe's 2 s
    # requests) do not make it plan for a burst of streams all as short, each with a prefill to
    # repay in 2 s (an H100 stack, 2026-12-05: capacity 256-384 at idle refused two thirds of
    # the next burst of 10 s streams).
    PRIOR_STREAMS = 8

    def mean_stream_s(self) -> float | None:
        """Mean expected length of the running streams and the next waiting one, with
        `PRIOR_STREAMS` of the default length beside them (None: no admission, nothing known);
        O(1): the running streams' sum and count are kept by `RunningStreams`."""
        s = self._s
        total, n = s.running.length_frames, s.running.num_lengths
        if s.waiting and (frames := length_frames(s.waiting[0])):
            total, n = total + frames, n + 1
        if not n:
            return None
        seconds = total * s.policy.frame_s
        if s.admission is None:
            return seconds / n
        prior = self.PRIOR_STREAMS
        return (seconds + prior * s.admission.config.default_stream_s) / (n + prior)

    def retry_after(self, now: float, ahead: int = 0, wait: float | None = None) -> int | None:
        """Whole seconds a refused request should wait before retrying: the queue's measured drain
        time, or `wait` (the predicted wait to start) when that is longer."""
        adm = self._s.admission
        if adm is None:
            return None
        drain = adm.retry_after_s(len(self._s.waiting) + ahead, now, self.waiting_since())
        if wait is not None and math.isfinite(wait):
            drain = max(drain, min(60, math.ceil(wait)))
        return drain

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

    def _ends(self, now: float) -> list[float]:
        """When each running stream is expected to end, from now, soonest first (worked out at most
        once per `ENDS_REUSE_S` while the streams are unchanged)."""
        kept = self._ends_at
        if kept is not None and 0.0 <= now - kept[0] <= ENDS_REUSE_S:
            return [max(0.0, end - now) for end in kept[1]]
        ends = sorted(self._finish_in_s(r, now) for r in self._s.running.values())
        self._ends_at = (now, [now + e for e in ends])
        return ends

    def refuse_late(self, now: float, plan: StepPlan) -> None:
        """Refuse (into `plan`) the waiting requests, from the back of the queue, whose predicted
        start has moved past their first-audio budget (the forecast learned more since
        they queued: a slower step, a stalled queue), rather than after they waited it out."""
        s = self._s
        adm = s.admission
        if adm is None or adm.config.first_audio_budget_s <= 0 or not s.waiting:
            return
        budget = adm.config.first_audio_budget_s
        cap = self.capacity()
        ends = None  # the running streams' ends, sorted only when the queue reaches past capacity
        while s.waiting:
            position = len(s.waiting) - 1
            req = s.waiting[position]
            if ends is None and len(s.running) + position + 1 > cap:
                ends = self._ends(now)
            # The measured rate, not a stall: admissions come a step's worth at a time, and the
            # pause between two steps is no stall; `refuse_expired` ends a real one.
            wait = self.wait_at(now, position, ends, stalled=False)
            start = now - req.submitted_at + (wait or 0.0)
            if wait is None or start <= budget:
                return
            s.waiting.pop()
            plan.refused.append(
                (
                    req,
                    ResourceExhausted(
                        f"the talker is at capacity: the request would start in about "
                        f"{start:.1f} s, past the {budget:g} s first-audio budget; retry later",
                        self.retry_after(now, 0, wait),
                    ),
                )
            )

    def _length_s(self, req: ScheduledRequest) -> float | None:
        """A stream's expected length in seconds of audio (None: unknown)."""
        total = length_frames(req)
        return total * self._s.policy.frame_s if total else None

    def _finish_in_s(self, req: ScheduledRequest, now: float) -> float:
        """When a running stream is expected to end generating, from now: once the rest of its
        audio is generated, as far ahead of its listener as it is now or as the scheduler keeps
        it when streams wait (`urgent_lead_s`), whichever is more (`max_lead_s` at most)."""
        length = self._length_s(req)
        if length is None:
            return math.inf
        pol = self._s.policy
        played = 0.0 if req.first_audio_at is None else now - req.first_audio_at
        lead = pol.urgent_lead_s
        if req.clock_running:
            lead = min(max(lead, req.lead_s(now, pol.frame_s)), pol.max_lead_s)
        return max(0.0, length - played - lead)
