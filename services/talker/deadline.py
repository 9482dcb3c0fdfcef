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
from dataclasses import dataclass, field

from qtts.request.errors import ResourceExhausted, TTSError

from .admission import Admission, StepModel
from .forecast import QueueForecast
from .scheduled import FRAME_S, RunningStreams, ScheduledRequest, StreamCredit

__all__ = [
    "FRAME_S",
    "DeadlinePolicy",
    "DeadlineScheduler",
    "RunningStreams",
    "ScheduledRequest",
    "StepPlan",
    "StreamCredit",
]


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
    # The wait is for throughput, which only an engine at its capacity needs: it scales from
    # none at a predicted engine load (admission.Admission.load) of `coalesce_from_load` to all
    # of `coalesce_s` at `coalesce_full_load`, and while requests queue for their start it is
    # always the whole wait. The wait also throttles admission (prompts held for company fill
    # the next step's prefill room): without the queue's rule, 0.45 to 0.75 let a closed loop
    # past capacity start streams faster than it kept them on time (74 of 407 gapped on the
    # simulated clock, none from 0.3 to 0.6). Below capacity the wait only delayed first audio:
    # in the open loop on an H100 (mixed 2-20 s, two stacks a side, 8e6c9ec) new prompts waited
    # 17 ms on average (p90 60 ms) with 0.45 to 0.75, and without any wait first audio's p95
    # fell from 190 to 162 ms at 100 requests/s and from 363 to 271 ms at 150, with no stream
    # gapped either way. So by default prompts wait only from capacity (a load of 1) on, which
    # in practice means while requests queue. coalesce_full_load 0: always the whole wait.
    coalesce_from_load: float = 1.0
    coalesce_full_load: float = 1.25
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

    def add_urgent(self, req: ScheduledRequest, slack: float, left: float, critical_s: float) -> None:
        """`req` (its clock running, `slack` buffered, `left` once its next chunk is made) must step."""
        self.urgent.append(req)
        self.critical = self.critical or left < critical_s
        need = req.frames_to_next_chunk()
        self.frame_budget = min(self.frame_budget, max(slack, 0.0) / need)


@dataclass
class _RunningView:
    """The running streams as admission sees them (`DeadlineScheduler._running_view`)."""

    behind: int = 0
    mature: int = 0
    prefill_pending: int = 0
    tightest: float = math.inf


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
        # The tightest stream's time left at the last step's plan (what bounded its prefill; the
        # admission trace records it).
        self.last_tightest_s = math.inf
        self.forecast = QueueForecast(self)

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
        more requests not submitted yet before it (`QueueForecast.refusal`)."""
        return self.forecast.refusal(now, ahead)

    def predicted_wait_s(self, now: float, ahead: int = 0) -> float | None:
        """How long a request submitted now would wait to start (`QueueForecast.predicted_wait_s`)."""
        return self.forecast.predicted_wait_s(now, ahead)

    def _mean_stream_s(self) -> float | None:
        return self.forecast.mean_stream_s()

    def remove(self, request_id: str) -> tuple[ScheduledRequest | None, bool]:
        """Forget a request; returns it and whether it was running (so the generator holds it)."""
        req = self.running.pop(request_id, None)
        self.forecast.streams_changed()
        if req is not None:
            return req, True
        for w in self.waiting:
            if w.request_id == request_id:
                self.waiting.remove(w)
                return w, False
        return None, False

    # -- planning -------------------------------------------------------------------------------
    def plan(self, now: float) -> StepPlan:
        """Admit, refuse the requests past their budget, and decide the next step."""
        plan = StepPlan()
        self.forecast.streams_changed()  # a step ran since the last plan
        self.forecast.refuse_expired(now, plan)
        self.forecast.refuse_late(now, plan)
        self._admit(now, plan)
        model = self.admission.model if self.admission is not None else None
        # A frame of every stream costs the GPU its step and, on a GPU the decoder shares, its
        # decode: the time a stream's next chunk takes, so how soon it must step.
        step_s = self.admission.frame_gpu_s(len(self.running)) if self.admission is not None else 0.0
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
        soon: list[tuple[float, ScheduledRequest, float, float]] = []  # (lead, stream, slack, time left)
        frame_s = pol.frame_s
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
            slack, left = req.playing_slack_s(now, step_s)
            if slack >= 0 and left < out.tightest:  # a stream already dry (a slow reader) sets no budget
                out.tightest = left
            if left < backlog_lead:
                out.add_urgent(req, slack, left, pol.critical_s)
                continue
            lead = req.credit.generated * frame_s - (now - req.first_audio_at)  # req.lead_s
            if left < pol.urgent_lead_s:
                soon.append((lead, req, slack, left))
                continue
            if lead >= pol.max_lead_s:
                plan.skip.add(rid)
                plan.num_paused += 1
            else:
                out.optional.append((lead, req))
            out.wake_at = min(out.wake_at, now + left - pol.urgent_lead_s)
        if soon and (self.waiting or out.prefilling):
            out.optional.extend((lead, req) for lead, req, _, _ in soon)
            out.wake_at = min(out.wake_at, now + min(left for _, _, _, left in soon) - backlog_lead)
        else:  # no backlog: the usual urgency
            for _, req, slack, left in soon:
                out.add_urgent(req, slack, left, pol.critical_s)
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
        self.last_tightest_s = streams.tightest
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
        """The share of `coalesce_s` new prompts wait: all of it while requests queue for their
        start (overload: the prefills' throughput is the capacity, and the prompts held for
        company also hold admission, `Admission.allows`' `prefill_room`); otherwise 0 up to
        `coalesce_from_load` of predicted engine load with the running streams, 1 from
        `coalesce_full_load` on (1 without a model)."""
        pol, adm = self.policy, self.admission
        if pol.coalesce_full_load <= 0 or adm is None or self.waiting:
            return 1.0
        load = adm.load(len(self.running), self._mean_stream_s())
        share = (load - pol.coalesce_from_load) / (pol.coalesce_full_load - pol.coalesce_from_load)
        return min(1.0, max(0.0, share))

    @staticmethod
    def _waits_for_text(req: ScheduledRequest, now: float) -> bool:
        """Whether the stream has no text for its next frame (and, when the text came back after
        its listener ran dry, restart its playback clock)."""
        if req.waits_for_text():
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

    def _admit(self, now: float, plan: StepPlan) -> None:
        adm = self.admission
        limit = self.max_batch
        if adm is not None:  # a burst ramps up, so the measurements can react
            limit = min(limit, len(self.running) + adm.config.max_admit_per_step)
        if adm is None or not self.waiting:
            view, mean_s, room = _RunningView(), None, math.inf
        else:
            view = self._running_view(now, adm.frame_gpu_s(len(self.running)))
            mean_s = self._mean_stream_s()
            room = self._prefill_budget(view.tightest)
        if adm is not None and self.waiting:
            adm.note_queue(now, False)  # requests arrived since the last plan: not idle
        while self.waiting and len(self.running) < limit:
            req = self.waiting[0]
            positions = req.prefill_positions
            if adm is not None and not adm.allows(
                len(self.running), view.behind, view.mature, mean_s, view.prefill_pending, room, positions
            ):
                break
            self.waiting.popleft()
            req.admitted_at = now
            self.running[req.request_id] = req
            self.forecast.streams_changed()
            plan.admitted.append(req)
            view.prefill_pending += positions
        if adm is not None:
            # The queue's drain is measured only while a backlog lasts, by plans that left
            # requests waiting (a limit stopped them: the step's admissions, its prefill room,
            # the load). One that emptied the queue started what had arrived, and its pace is the
            # arrivals': a voice-pool warm-up of short requests from 8 clients measured 150 a
            # second, and the next burst was let in up to 3 s of that (an H100 stack: 446 of
            # 512, each started within 1.6 s; HISTORY.md, eighth session of 2026-12-06). With
            # the talker idle for a while the backlog's rate is forgotten (`Admission.note_queue`).
            backlog = bool(self.waiting)
            for req in plan.admitted:  # the plan's only admissions: _admit is their one source
                adm.observe_admit(now, req.submitted_at, backlog=backlog)
            adm.note_queue(now, not backlog and len(self.running) < self.forecast.capacity())

    def _running_view(self, now: float, step_s: float) -> _RunningView:
        """What admission weighs of the running streams: how many ran dry of the ones with audio,
        the prompt positions admitted and not yet prefilled, and the tightest stream's time left
        (which bounds the next step's prefill). A pass over the running streams, once per plan and
        only while requests wait: it runs before the plan's own pass, whose admitted streams must
        be in the running set, and a view kept from the previous plan would admit on a step-old
        view of the listeners."""
        view = _RunningView()
        for req in self.running.values():
            if not req.stepped:
                view.prefill_pending += req.prefill_positions
            if req.clock_running and not req.text_waiting:
                view.mature += 1
                slack, left = req.playing_slack_s(now, step_s)
                if slack < 0:
                    view.behind += 1
                elif left < view.tightest:
                    view.tightest = left
        return view
