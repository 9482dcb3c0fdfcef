"""Which requests run, which wait, and which step next, by playback deadline: pure bookkeeping.

Layers: this deadline scheduler is the one queue a request waits in, and decides who runs and who
steps when; the generator's slot scheduler (qtts/engine/slot_scheduler.py) only places the
streams it is given in KV slots, prefill chunks and decode rows, and the engine
(qtts/engine/engine.py) runs that on the GPU. It starts at most `max_batch` streams at once: the
generator's slot count (`GenerationLoop` checks), so a started request always finds a slot.

Every running stream carries a playback clock: its listener starts playing when the first chunk
is handed on, so from then on the stream owes one frame (80 ms of audio) per 80 ms of wall time.
Two numbers come from it:

- *time left*: the audio the listener has buffered, minus the time to generate the rest of the
  stream's next chunk (audio reaches it a whole chunk at a time). A stream without audio yet, or
  with less time left than `urgent_lead_s`, is urgent: a step runs now;
- *lead*: the audio generated minus the wall time since the first audio. A step takes every
  stream whose lead is under `max_lead_s` (as wide as possible: the batched step costs little
  more per extra row) and pauses those further ahead, so new and late streams get the steps and
  the GPU time instead of streams racing ahead of their listeners;
- when no stream is urgent, no step runs: the engine sleeps until the first one will be
  (`StepPlan.wake_at`). In steady state every stream then steps together about once per frame,
  in one wide batch, and the GPU is free in between for prefill and for the decoder.

Prefill of new prompts is budgeted per step from the tightest running stream's slack, so a new
prompt never makes a running stream late. Admission (`admission.Admission`) starts a waiting
request only when the predicted step with it stays within its share of a frame; waiting
requests have a first-audio budget and are refused with a retry hint past it, or at once when the
queue's drain rate says they could not start within it.

A stream never runs further ahead of code2wav's credit than its `window` (its send buffer bound),
whatever its lead.

A stream whose text is still arriving (an open `TextFeed`) and has none for its next frame is
skipped: it waits in the batch. Its listener plays out what it has and then waits for the text,
which is not a gap of ours, so its playback clock pauses: when the text comes back after the
listener ran dry, the clock restarts with the next chunk handed on (as at the first chunk), and
until then the stream counts as one without audio yet (urgent, never late or behind).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qtts.request.errors import ResourceExhausted, TTSError, Unavailable

from .admission import Admission, StepModel

FRAME_S = 0.08  # one codec frame: 1920 samples at 24 kHz


@dataclass(frozen=True)
class DeadlinePolicy:
    """How far ahead of its listener a stream runs; seconds of audio."""

    urgent_lead_s: float = 2.0
    max_lead_s: float = 4.0
    # While requests wait to start or for their prefill (a backlog), a playing stream is urgent
    # only under this lead: the GPU time that built every stream's lead up to `urgent_lead_s`
    # goes to the waiting prompts and first chunks instead, as long as no listener gets close
    # to running dry. None: `urgent_lead_s` always.
    backlog_lead_s: float | None = None
    # The longest step a first chunk (a stream without audio yet) rides in: running streams that
    # are not urgent join it only up to this predicted step time, so a new stream's first frames
    # are not slowed by a wide batch of streams that could wait. Urgent streams always join.
    first_chunk_step_s: float = FRAME_S / 2
    # Prefill positions per step when a running stream is close to its deadline, and at most.
    min_prefill_positions: int = 320
    max_prefill_positions: int = 4096
    # While streams are playing, new prompts wait up to `coalesce_s` for one another (or until
    # `coalesce_rows` are there) and are prefilled in one step: a step with a prefill cost about
    # 30 ms more than one without whether it held one prompt or eight, so prefilling each prompt
    # as it came made every step a slow one under a steady stream of arrivals. 0: no waiting.
    coalesce_s: float = 0.12
    coalesce_rows: int = 8
    # The wait is for throughput, which only a busy engine needs: it scales from none at a
    # predicted engine load (admission.Admission.load) of `coalesce_from_load` to all of
    # `coalesce_s` at `coalesce_full_load`, so a lightly loaded server starts audio at once.
    # coalesce_full_load 0: always the whole wait.
    coalesce_from_load: float = 0.3
    coalesce_full_load: float = 0.6
    # Steps for streams that are due but not short start at most this often, so the streams
    # that fall under the lead bound meanwhile join one wide step instead of many narrow ones
    # (each step costs about 5 ms whatever its width). Streams with less than `critical_s`
    # left, and new streams' first chunks, step at once. 0: every due stream steps at once.
    min_step_interval_s: float = 0.0
    critical_s: float = 0.3
    frame_s: float = FRAME_S

    def __post_init__(self) -> None:
        if self.urgent_lead_s < 0 or self.max_lead_s < self.urgent_lead_s:
            raise ValueError("leads must satisfy 0 <= urgent_lead_s <= max_lead_s")
        if (
            self.backlog_lead_s is not None
            and not self.critical_s <= self.backlog_lead_s <= self.urgent_lead_s
        ):
            raise ValueError("backlog_lead_s must satisfy critical_s <= backlog_lead_s <= urgent_lead_s")
        if self.first_chunk_step_s <= 0:
            raise ValueError("first_chunk_step_s must be > 0")
        if self.min_prefill_positions < 1 or self.max_prefill_positions < self.min_prefill_positions:
            raise ValueError("prefill positions must satisfy 1 <= min <= max")
        if self.min_step_interval_s < 0 or self.critical_s < 0:
            raise ValueError("min_step_interval_s and critical_s must be >= 0")
        if self.coalesce_s < 0 or self.coalesce_rows < 1:
            raise ValueError("coalesce_s must be >= 0 and coalesce_rows >= 1")
        if self.coalesce_full_load > 0 and not 0 <= self.coalesce_from_load < self.coalesce_full_load:
            raise ValueError("coalesce loads must satisfy 0 <= coalesce_from_load < coalesce_full_load")


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
    # Frames generated and not yet handed to the event loop (engine thread only).
    held_codes: list = field(default_factory=list)
    # Text still arriving (qtts.model.text_feed.TextFeed; None: the whole text is in the prompt).
    text: Any = None
    # Skipped for lack of text in the last plan; and, once the text came back after the
    # listener ran dry, the playback clock restarts at the next chunk handed on.
    text_waiting: bool = False
    clock_restart: bool = False

    @property
    def clock_running(self) -> bool:
        """Whether the listener is playing: audio was handed on and the clock is not paused."""
        return self.first_audio_at is not None and not self.clock_restart

    def hand_on_now(self) -> bool:
        """Whether the frames held so far go to the event loop now: at a chunk boundary, when the
        credit stops the stream, or while the chunk plan is unknown (frame by frame)."""
        plan = self.chunk_plan
        generated = self.credit.generated
        return plan is None or plan.end_at_or_below(generated) == generated or not self.credit.has_credit()

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
        generated = self.credit.generated
        if self.chunk_plan is None:
            return 1
        return max(1, self.chunk_plan.end_after(generated) - generated)

    def time_left_s(self, now: float, step_s: float) -> float:
        """Slack left once the frames of its next chunk are generated at `step_s` a frame: how
        long a step may be delayed before this stream's listener runs dry."""
        slack = self.slack_s(now)
        if self.chunk_plan is None or math.isinf(slack):
            return slack
        return slack - self.frames_to_next_chunk() * step_s


@dataclass
class _SortedStreams:
    """The running streams sorted by one plan: what must step, what may ride along, and the
    bounds the urgent ones set."""

    urgent: list[ScheduledRequest] = field(default_factory=list)
    optional: list[tuple[float, ScheduledRequest]] = field(default_factory=list)  # (lead, stream)
    prefilling: list[ScheduledRequest] = field(default_factory=list)  # admitted, not prefilled
    playing: int = 0
    critical: bool = False  # a stream must step now (a first chunk, or short of audio)
    wake_at: float = math.inf
    tightest: float = math.inf  # time left of the tightest stream with audio, still on time
    frame_budget: float = math.inf  # longest step the urgent streams' next chunks allow

    def add_first_chunk(self, req: ScheduledRequest, step_s: float) -> None:
        self.urgent.append(req)
        self.critical = True
        self.frame_budget = min(self.frame_budget, step_s)

    def add_urgent(self, req: ScheduledRequest, now: float, left: float, critical_s: float) -> None:
        self.urgent.append(req)
        self.critical = self.critical or left < critical_s
        need = req.frames_to_next_chunk()
        self.frame_budget = min(self.frame_budget, max(req.slack_s(now), 0.0) / need)


def _length_frames(req: ScheduledRequest) -> Any:
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
        frames = _length_frames(req)
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


@dataclass
class StepPlan:
    """The engine's next move: start `admitted`, refuse `refused`, and step unless `step` is False.

    `skip` lists running streams that must not advance (no credit, or paused far ahead);
    `prefill_budget` bounds the prompt positions prefilled in the step; without a step, the engine
    sleeps until `wake_at` (None: until something happens)."""

    admitted: list[ScheduledRequest] = field(default_factory=list)
    refused: list[tuple[ScheduledRequest, ResourceExhausted]] = field(default_factory=list)
    skip: set[str] = field(default_factory=set)
    stepping: list[ScheduledRequest] = field(default_factory=list)
    step: bool = False
    wake_at: float | None = None
    prefill_budget: int | None = None
    num_paused: int = 0
    num_credit_stalled: int = 0
    num_text_waiting: int = 0


class DeadlineScheduler:
    """Waiting queue (bounded, with a first-audio budget) and the running set, stepped by deadline."""

    def __init__(
        self,
        max_batch: int,
        max_waiting: int,
        admission: Admission | None = None,
        policy: DeadlinePolicy | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.admission = admission
        self.policy = policy or DeadlinePolicy()
        self.waiting: deque[ScheduledRequest] = deque()
        self.running = RunningStreams()
        self.admitting = True
        self._last_step_at = -math.inf

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def holding_reason(self) -> str:
        """Why waiting requests are held back ("" when they are not)."""
        if not self.waiting or self.admission is None:
            return ""
        return self.admission.reason

    # -- queue --------------------------------------------------------------------------------
    def submit(self, req: ScheduledRequest, now: float) -> None:
        """Queue a request; it starts when admission allows.

        Raises Unavailable while draining, and ResourceExhausted when the queue is full or the
        queue's drain rate says the request could not start within its first-audio budget.
        """
        if req.request_id in self.running or any(w.request_id == req.request_id for w in self.waiting):
            raise ResourceExhausted(f"request id {req.request_id!r} is already in progress")
        refusal = self.refusal(now)
        if refusal is not None:
            raise refusal
        req.submitted_at = now
        self.waiting.append(req)

    def refusal(self, now: float, ahead: int = 0) -> TTSError | None:
        """The error `submit` would refuse a request with now (None: it would queue), with `ahead`
        more requests before it that are not submitted yet (prompts still being built): so a
        request can be refused before its prompt is built, not after waiting behind the others."""
        if not self.admitting:
            return Unavailable("the talker is draining and admits no new requests")
        queued = len(self.waiting) + ahead
        if len(self.running) + queued >= self.max_batch + self.max_waiting:
            return ResourceExhausted(
                f"the talker is at capacity ({self.max_batch} streams generating, "
                f"{self.max_waiting} waiting); retry later",
                self._retry_after(now, ahead),
            )
        adm = self.admission
        if adm is not None and adm.config.first_audio_budget_s > 0:
            wait = self.predicted_wait_s(now, ahead)
            if wait is not None and wait > adm.config.first_audio_budget_s:
                return ResourceExhausted(
                    f"the talker is at capacity: {queued} requests wait to start, about "
                    f"{wait:.1f} s, over the {adm.config.first_audio_budget_s:g} s first-audio budget",
                    self._retry_after(now, ahead),
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
        adm = self.admission
        if adm is None:
            return None
        waits = []
        queued = len(self.waiting) + ahead
        if queued:
            rate_wait = adm.predicted_wait_s(queued, now, self._waiting_since())
            if rate_wait is not None:
                waits.append(rate_wait)
        cap = adm.capacity(self._mean_stream_s())
        if cap is not None:
            need = len(self.running) + queued + 1 - cap
            if need > 0:
                ends = sorted(self._finish_in_s(r, now) for r in self.running.values())
                end = ends[need - 1] if need <= len(ends) else math.inf
                if not math.isinf(end):  # streams of unknown length give no estimate
                    waits.append(end)
        return max(waits) if waits else None

    def _length_s(self, req: ScheduledRequest) -> float | None:
        """A stream's expected length in seconds of audio (None: unknown)."""
        total = _length_frames(req)
        return total * self.policy.frame_s if total else None

    def _mean_stream_s(self) -> float | None:
        """Mean expected length of the running streams and the next waiting one (None: unknown);
        O(1): the running streams' sum and count are kept by `RunningStreams`."""
        total, n = self.running.length_frames, self.running.num_lengths
        if self.waiting and (frames := _length_frames(self.waiting[0])):
            total, n = total + frames, n + 1
        return total * self.policy.frame_s / n if n else None

    def _finish_in_s(self, req: ScheduledRequest, now: float) -> float:
        """When a running stream is expected to end generating, from now."""
        length = self._length_s(req)
        if length is None:
            return math.inf
        played = 0.0 if req.first_audio_at is None else now - req.first_audio_at
        return max(0.0, length - played - self.policy.max_lead_s)

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

    def _retry_after(self, now: float, ahead: int = 0) -> int | None:
        if self.admission is None:
            return None
        return self.admission.retry_after_s(len(self.waiting) + ahead, now, self._waiting_since())

    def _waiting_since(self) -> float | None:
        """When the oldest waiting request was submitted (None: none waits)."""
        return self.waiting[0].submitted_at if self.waiting else None

    # -- planning -------------------------------------------------------------------------------
    def plan(self, now: float) -> StepPlan:
        """Admit, refuse the requests past their budget, and decide the next step."""
        plan = StepPlan()
        self._refuse_expired(now, plan)
        self._admit(now, plan)
        model = self.admission.model if self.admission is not None else None
        step_s = model.predict(len(self.running)) if model is not None else 0.0
        return self._decide_step(plan, now, model, self._sort_running(plan, now, step_s))

    def _sort_running(self, plan: StepPlan, now: float, step_s: float) -> _SortedStreams:
        """The running streams by what the next step owes them: skipped (no text, no credit, far
        enough ahead), urgent, optional riders, or admitted and waiting for their prefill."""
        pol = self.policy
        out = _SortedStreams()
        # Under a backlog a playing stream is urgent only under the backlog lead; those between
        # it and the urgent lead ("soon") wait as optional riders, and become urgent again when
        # the plan finds no backlog after all (nothing waiting to start or to be prefilled).
        backlog_lead = pol.urgent_lead_s if pol.backlog_lead_s is None else pol.backlog_lead_s
        soon: list[tuple[float, ScheduledRequest, float]] = []  # (lead, stream, time left)
        for rid, req in self.running.items():
            if req.text is not None and self._waits_for_text(req, now):
                plan.skip.add(rid)
                plan.num_text_waiting += 1
                continue
            if not req.credit.has_credit():
                plan.skip.add(rid)
                plan.num_credit_stalled += 1
                continue
            if not req.clock_running:
                # Before its first audio is handed on, a stream is the most urgent work there is.
                if not req.stepped:
                    out.prefilling.append(req)  # urgent too, unless its prefill waits for company
                else:
                    out.add_first_chunk(req, pol.first_chunk_step_s)
                continue
            out.playing += 1
            left = req.time_left_s(now, step_s)
            if req.slack_s(now) >= 0:  # a stream already dry (a slow reader) sets no budget
                out.tightest = min(out.tightest, left)
            if left < backlog_lead:
                out.add_urgent(req, now, left, pol.critical_s)
                continue
            lead = req.lead_s(now, pol.frame_s)
            if left < pol.urgent_lead_s:
                soon.append((lead, req, left))
                continue
            if lead >= pol.max_lead_s:
                plan.skip.add(rid)
                plan.num_paused += 1
            else:
                out.optional.append((lead, req))
            out.wake_at = min(out.wake_at, now + left - pol.urgent_lead_s)
        if soon and (self.waiting or out.prefilling):
            out.optional.extend((lead, req) for lead, req, _ in soon)
            out.wake_at = min(out.wake_at, now + min(left for _, _, left in soon) - backlog_lead)
        else:  # no backlog: the usual urgency
            for _, req, left in soon:
                out.add_urgent(req, now, left, pol.critical_s)
        return out

    def _decide_step(
        self, plan: StepPlan, now: float, model: StepModel | None, streams: _SortedStreams
    ) -> StepPlan:
        """`plan`'s second half, once the running streams are sorted: hold or join the prompts
        waiting for their prefill, then sleep until the first stream is due, or step the urgent
        streams and as many optional ones as the budget allows."""
        pol = self.policy
        urgent, optional, prefilling = streams.urgent, streams.optional, streams.prefilling
        hold_prefill = False
        if prefilling:
            until = self._coalesce_until(prefilling, streams.playing, now)
            if until is None:
                for req in prefilling:
                    streams.add_first_chunk(req, pol.first_chunk_step_s)
            else:
                hold_prefill = True
                streams.wake_at = min(streams.wake_at, until)
        if urgent and not streams.critical and now < self._last_step_at + pol.min_step_interval_s:
            # Due, but none short: wait for the streams falling under the lead bound to join.
            streams.wake_at = min(streams.wake_at, self._last_step_at + pol.min_step_interval_s)
            urgent = []
        if not urgent:
            # Nobody is due yet: sleep until the first stream will be.
            plan.skip.update(r.request_id for _, r in optional)
            plan.skip.update(r.request_id for r in prefilling)
            plan.wake_at = None if math.isinf(streams.wake_at) else streams.wake_at
            return plan
        self._last_step_at = now
        # As wide as the tightest urgent stream allows: the streams least ahead join first.
        optional.sort(key=lambda item: item[0])
        room = len(optional)
        budget = streams.frame_budget
        if model is not None and not math.isinf(budget) and model.per_stream_s > 0:
            room = int((budget - model.base_s) / model.per_stream_s) - len(urgent)
            room = max(0, min(room, len(optional)))
        plan.stepping = urgent + [r for _, r in optional[:room]]
        plan.skip.update(r.request_id for _, r in optional[room:])
        plan.step = True
        plan.prefill_budget = 0 if hold_prefill else self._prefill_budget(streams.tightest)
        return plan

    def _coalesce_until(self, prefilling: list[ScheduledRequest], playing: int, now: float) -> float | None:
        """Until when the prompts waiting for their prefill wait for more to join them (None:
        prefill now). Nothing waits while no stream plays (an idle server starts at once), once
        a full batch of prompts is there, or past the wait from the oldest one's admission: up to
        `coalesce_s`, scaled by how loaded the engine is (`_coalesce_share`)."""
        pol = self.policy
        if pol.coalesce_s <= 0 or playing == 0 or len(prefilling) >= pol.coalesce_rows:
            return None
        wait = pol.coalesce_s * self._coalesce_share()
        if wait <= 0:
            return None
        until = min(r.admitted_at for r in prefilling) + wait
        return until if now < until else None

    def _coalesce_share(self) -> float:
        """The share of `coalesce_s` new prompts wait: 0 up to `coalesce_from_load` of predicted
        engine load with the running streams, 1 from `coalesce_full_load` on (1 without a model)."""
        pol, adm = self.policy, self.admission
        if pol.coalesce_full_load <= 0 or adm is None:
            return 1.0
        load = adm.load(len(self.running), self._mean_stream_s())
        share = (load - pol.coalesce_from_load) / (pol.coalesce_full_load - pol.coalesce_from_load)
        return min(1.0, max(0.0, share))

    @staticmethod
    def _waits_for_text(req: ScheduledRequest, now: float) -> bool:
        """Whether the stream has no text for its next frame (and, when the text came back after
        its listener ran dry, restart its playback clock)."""
        if not req.text.ready(req.credit.generated):
            req.text_waiting = True
            return True
        if req.text_waiting:
            req.text_waiting = False
            if req.first_audio_at is not None and req.slack_s(now) < 0:
                req.clock_restart = True
        return False

    def _prefill_budget(self, tightest_slack_s: float) -> int:
        """Prompt positions the step may prefill without making the tightest stream late.

        Only one step's slack bounds it, not the urgent streams' per-frame budget: a step with a
        prefill costs about the same whatever its size, so a per-frame bound only slowed a
        burst's prefill without shortening the steps (BENCHMARKS.md, sixth H200 session)."""
        pol = self.policy
        if self.admission is None or math.isinf(tightest_slack_s):
            return pol.max_prefill_positions
        model = self.admission.model
        spare = tightest_slack_s - self.admission.config.safety_s
        per = max(model.prefill_position_s, 1e-9)
        return int(min(pol.max_prefill_positions, max(pol.min_prefill_positions, spare / per)))

    def _refuse_expired(self, now: float, plan: StepPlan) -> None:
        adm = self.admission
        if adm is None or adm.config.first_audio_budget_s <= 0:
            return
        budget = adm.config.first_audio_budget_s
        while self.waiting and now - self.waiting[0].submitted_at > budget:
            req = self.waiting.popleft()
            waited = now - req.submitted_at
            plan.refused.append(
                (
                    req,
                    ResourceExhausted(
                        f"the talker is at capacity: the request waited {waited:.1f} s to start, "
                        f"past the {budget:g} s first-audio budget; retry later",
                        self._retry_after(now),
                    ),
                )
            )

    def _admit(self, now: float, plan: StepPlan) -> None:
        adm = self.admission
        limit = self.max_batch
        if adm is not None:  # a burst ramps up, so the measurements can react
            limit = min(limit, len(self.running) + adm.config.max_admit_per_step)
        if adm is None or not self.waiting:
            behind, mature, mean_s = 0, 0, None
        else:
            behind, mature = self._behind(now)
            mean_s = self._mean_stream_s()
        while self.waiting and len(self.running) < limit:
            req = self.waiting[0]
            if adm is not None and not adm.allows(len(self.running), behind, mature, mean_s):
                return
            self.waiting.popleft()
            req.admitted_at = now
            self.running[req.request_id] = req
            plan.admitted.append(req)
            if adm is not None:
                adm.observe_admit(now, req.submitted_at)

    def _behind(self, now: float) -> tuple[int, int]:
        """(streams whose listener ran dry, streams with audio). A pass over the running streams,
        once per plan and only while requests wait: it runs before the plan's own pass, whose
        admitted streams must be in the running set, and a count kept from the previous plan
        would admit on a step-old view of the listeners."""
        behind = mature = 0
        for req in self.running.values():
            if req.clock_running and not req.text_waiting:
                mature += 1
                behind += req.slack_s(now) < 0
        return behind, mature
