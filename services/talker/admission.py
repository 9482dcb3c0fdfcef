"""Admission from measured capacity: a waiting request starts only when, with it, every running
stream still meets its playback deadline.

Two predictions decide it, both from what the engine measured on this GPU:

- the frame step: `StepModel` fits step time = base + per_stream * batch from the steps it saw
  (steps with a prefill are left out), each figure a trimmed mean of the recent steps, so that
  one slow step (a stall, a burst of another process's work on a shared GPU) does not move the
  capacity. With one more stream, stepping every running stream at
  once must take at most `max_duty` of a frame's 80 ms, leaving the rest of the GPU to prefill and
  to the decoder sharing it;
- the steady load: with one more stream, the frame steps (every stream about once a frame) plus
  the prefills of the streams that replace those ending (running streams / their mean length, each
  at its measured prefill cost) must keep the engine thread busy at most `max_load` of the time.
  A prefill is the dearer part (a step with one costs several frame steps), so a bound on the
  step alone admitted streams the engine could not keep on time;
- the newcomer's own prefill is not a condition: the scheduler spreads it over steps within the
  slack of the tightest running stream (young streams always have little slack, so holding
  admission on it refused most requests).

When the decoder (code2wav) runs on the same GPU, each running stream also costs the GPU its
decode: `decoder_frame_s` per stream and frame, and the decoder's per-call cost at the rate it
calls (`decoder_call_load`, a busy fraction). code2wav measures both on its GPU and publishes them
on its credit grants; with `decoder_shares_gpu` the published figures replace the
`--decoder-frame-us` prior as they arrive (`observe_decoder`), without it they are ignored (the
decoder runs on other GPUs) and the flag alone counts. The steady load counts the decode beside
the frame steps and the prefills, so admission stops at the two engines' combined limit, not at
the talker's alone (at 1,024 streams the decoder takes about a third of an H200). How the two
combine is `engine_costs`: "sum" (the default) adds them, as when the engines take turns on the GPU;
"overlap" takes the busier, as when they run side by side under MPS, where each engine's measured
cost already includes its waits for the other and adding them counts the contention twice (an
H100 at c=1,024: the sum called 858 streams 96% of the GPU while the talker's steps took 27 ms
whether 260 or 690 streams wide and made 1.2x the frames their listeners needed; HISTORY.md, sixth
session of 2026-12-07).

Prompts admitted and not yet prefilled are GPU work already promised: admission holds while they
fill what the next step may prefill (`prefill_room`), so a burst is admitted as fast as the
engine prefills it, and a request waits for its start in the queue (where its predicted wait is
checked against its first-audio budget) rather than admitted and then kept from its prefill for
seconds.

Streams whose listener is short of audio (`behind`) mean the pipeline after the talker is not
keeping up: admission holds while more than `max_behind_fraction` of the mature streams are behind
(a fraction, so that one slow client cannot stop admission for everyone).

A request that cannot start waits in a bounded queue with a first-audio budget. `Admission` also
measures the queue's drain rate (admissions per second, while a backlog lasts: plans that start
every waiting request measure the arrivals, and an idle talker forgets the rate), so a request
whose predicted wait is past the budget is refused at once with a `Retry-After`, instead of after
waiting for nothing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits of capacity-based admission; 0 turns the duty and behind checks off."""

    max_duty: float = 0.6
    # Busy fraction of the engine thread that the predicted steady load may take (0: unchecked).
    max_load: float = 0.8
    # Longest a request waits for its start before it is refused; 0 = wait until the queue bound.
    first_audio_budget_s: float = 3.0
    # A new request queues only while its predicted start is within this share of the budget; once
    # queued it is refused only when its start is predicted past the whole budget. The margin
    # absorbs the forecast's drift, so a queued request starts rather than being refused after
    # a second or two (1.0: no margin).
    queue_budget_share: float = 0.5
    safety_s: float = 0.04
    max_behind_fraction: float = 0.05
    # At most this many start per step, so the measurements can react before the next ones start.
    max_admit_per_step: int = 16
    # Priors of the step model until steps are measured (a 1.7B frame step on a fast GPU).
    step_base_s: float = 0.0047
    step_per_stream_s: float = 0.00002
    prefill_position_s: float = 0.000011
    # Engine time one request's prefill adds to a step, and the stream length assumed while no
    # running stream says its own.
    prefill_request_s: float = 0.01
    default_stream_s: float = 10.0
    # The step model's memory: the last this many steps of each kind (small-batch steps for the
    # base, prefill steps for the prefill costs), and for the per-stream slope the recent steps
    # up to this many stream-steps (a step of batch b counts b), so that a run of small, noisy
    # batches displaces little of what the large ones measured.
    fit_steps: int = 64
    fit_stream_steps: int = 16_384
    # Which band of the recent steps the frame step's base and slope average (STEP_FITS).
    step_fit: str = "typical"
    # GPU time the decoder spends per stream and frame when it shares this GPU (0: it runs elsewhere):
    # a prior that code2wav's published measurements replace when `decoder_shares_gpu`.
    decoder_frame_s: float = 0.0
    decoder_shares_gpu: bool = False
    # How the talker's and the decoder's costs combine on a GPU they share (ENGINE_COSTS): "sum", the
    # engines take turns and a frame costs both; "overlap", they run side by side (MPS) and each
    # engine's measured cost already holds its waits for the other, so the busier one bounds.
    engine_costs: str = "sum"

    def __post_init__(self) -> None:
        if self.max_duty < 0 or self.max_load < 0 or self.first_audio_budget_s < 0 or self.safety_s < 0:
            raise ValueError("max_duty, max_load, first_audio_budget_s and safety_s must be >= 0")
        if not 0 < self.queue_budget_share <= 1:
            raise ValueError(f"queue_budget_share must be in (0, 1], got {self.queue_budget_share}")
        if self.default_stream_s <= 0 or self.prefill_request_s < 0 or self.decoder_frame_s < 0:
            raise ValueError("default_stream_s must be > 0, prefill_request_s and decoder_frame_s >= 0")
        if not 0.0 <= self.max_behind_fraction < 1.0:
            raise ValueError("max_behind_fraction must be in [0, 1)")
        if self.fit_steps < 1 or self.fit_stream_steps < 1:
            raise ValueError("fit_steps and fit_stream_steps must be >= 1")
        if self.step_fit not in STEP_FITS:
            raise ValueError(f"step_fit must be one of {', '.join(STEP_FITS)}, got {self.step_fit!r}")
        if self.max_admit_per_step < 1:
            raise ValueError("max_admit_per_step must be >= 1")
        check_engine_costs(self.engine_costs, self.step_fit)


# The weight band of the step samples each fit averages: the interquartile mean (the step as it
# runs beside the other engines, stalls left out), or the lower half (as it runs when they leave
# the GPU alone; the decoder's published cost is its own lower envelope too, so with it the two
# engines' own costs are summed rather than their contended ones).
_BANDS = {"typical": (0.25, 0.75), "uncontended": (0.0, 0.5)}
STEP_FITS = tuple(_BANDS)
ENGINE_COSTS = ("sum", "overlap")


def check_engine_costs(engine_costs: str, step_fit: str) -> None:
    """Raise ValueError for an unknown `engine_costs`, or "overlap" with the uncontended step fit:
    the faster half of the steps is the talker's step with less of the decoder's time in it, so
    the busier engine's bound then leaves part of the decoder out (on the simulated clock with the
    decoder's time in the talker's steps, 19-25 admitted streams ran dry by up to 69 ms where
    "typical" had none)."""
    if engine_costs not in ENGINE_COSTS:
        raise ValueError(f"engine_costs must be one of {', '.join(ENGINE_COSTS)}, got {engine_costs!r}")
    if engine_costs == "overlap" and step_fit == "uncontended":
        raise ValueError(
            "engine_costs 'overlap' takes each engine's cost as measured beside the other and needs "
            "step_fit 'typical' (uncontended leaves the decoder's share out)"
        )


def trimmed_mean(samples: Iterable[tuple[float, float]], lower: float = 0.25, upper: float = 0.75) -> float:
    """The weighted mean of (value, weight) samples between the `lower` and `upper` quantiles of
    their total weight (0.25, 0.75: the interquartile mean). Robust to a quarter of the weight
    being wild at either end, and nearer the mean than a median when the spread is honest.
    `samples` must not be empty."""
    ordered = sorted(samples)
    total = sum(w for _, w in ordered)
    if total <= 0:
        return ordered[len(ordered) // 2][0]
    lo, hi = lower * total, upper * total
    acc = kept = weighted = 0.0
    for value, weight in ordered:
        inside = min(acc + weight, hi) - max(acc, lo)
        if inside > 0:
            kept += inside
            weighted += inside * value
        acc += weight
    return weighted / kept if kept > 0 else ordered[len(ordered) // 2][0]


class StepModel:
    """Frame step time as base + per_stream * batch, fitted from measured steps.

    Small batches (<= 8) measure the base (launch-bound); larger ones the per-stream slope over it,
    each step's slope weighted by its batch (a slow step of 10 streams says little about a step of
    500). Each figure is a trimmed mean over a window of recent steps, not an exponential average:
    one stalled step moved an average with weight 0.1 by a tenth of its error, and on an H200
    shared with the decoder and the aligner the fitted slope swung 2x and the capacity from 32 to
    896 streams (HISTORY.md, 2026-12-05). The windows still follow a GPU that another process comes
    to share within a few dozen steps."""

    _SMALL = 8
    # Samples a window holds before its mean replaces the configured prior: a fresh talker's first
    # few steps (a cold start, one slow prefill) must not set its capacity alone.
    MIN_SAMPLES = 8

    def __init__(self, config: AdmissionConfig):
        self.base_s = config.step_base_s
        self.per_stream_s = config.step_per_stream_s
        self.prefill_position_s = config.prefill_position_s
        self.prefill_request_s = config.prefill_request_s
        self._max_stream_steps = config.fit_stream_steps
        self._band = _BANDS[config.step_fit]
        self._base: deque[tuple[int, float]] = deque(maxlen=config.fit_steps)
        # (batch, seconds) of large-batch steps; their slopes are taken over the base of the time
        # of the fit, so a base learnt later corrects them.
        self._large: deque[tuple[int, float]] = deque(maxlen=max(2 * config.fit_steps, 16))
        self._large_weight = 0
        self._position: deque[tuple[float, float]] = deque(maxlen=config.fit_steps)
        self._request: deque[tuple[float, float]] = deque(maxlen=config.fit_steps)

    def predict(self, batch: int) -> float:
        return self.base_s + self.per_stream_s * max(batch, 0)

    def observe(
        self, batch: int, seconds: float, prefill_positions: int = 0, prefill_requests: int = 0
    ) -> None:
        if batch < 1 or seconds <= 0 or not math.isfinite(seconds):
            return
        if prefill_positions > 0:
            extra = max(0.0, seconds - self.predict(batch))
            self._position.append((extra / prefill_positions, 1.0))
            if len(self._position) >= self.MIN_SAMPLES:
                self.prefill_position_s = trimmed_mean(self._position)
            if prefill_requests > 0:
                # Weighted by its prompts, as a step's slope is by its batch: the steady load's
                # prefills share steps as a burst's do, and an idle talker's one-prompt steps
                # (the whole of a prefill step's fixed cost on one prompt) must not outweigh them.
                self._request.append((extra / prefill_requests, float(prefill_requests)))
                if len(self._request) >= self.MIN_SAMPLES:
                    self.prefill_request_s = trimmed_mean(self._request)
            return
        if batch <= self._SMALL:
            # The intercept: a small batch's own streams taken off at the current slope.
            self._base.append((batch, seconds))
            if len(self._base) < self.MIN_SAMPLES:
                return
            slope = self.per_stream_s
            self.base_s = trimmed_mean([(max(0.0, s - slope * b), 1.0) for b, s in self._base], *self._band)
            return
        # A large batch measures the slope over the base (the prior until a small batch is seen).
        if len(self._large) == self._large.maxlen:
            self._large_weight -= self._large[0][0]
        self._large.append((batch, seconds))
        self._large_weight += batch
        while len(self._large) > 1 and self._large_weight - self._large[0][0] >= self._max_stream_steps:
            self._large_weight -= self._large.popleft()[0]
        if len(self._large) < self.MIN_SAMPLES and self._large_weight < self._max_stream_steps:
            return
        base = self.base_s
        self.per_stream_s = trimmed_mean(
            [(max(0.0, s - base) / b, float(b)) for b, s in self._large], *self._band
        )

    def prefill_s(self, positions: int) -> float:
        return self.prefill_position_s * max(positions, 0)


class Admission:
    """Decides whether the next waiting request may start; see the module docstring."""

    _DRAIN_MEMORY = 100  # admissions the drain rate averages over (about half a second in a burst)
    _SAME_EVENT_S = 1e-3  # admissions this close together are one event (one step's plan)
    _FORGET_AFTER_S = 0.25  # idle this long, the talker forgets its backlog's drain rate
    _RECENT_S = 1.0  # a stalled queue's drain rate is at least its admissions of this long ago on

    def __init__(self, config: AdmissionConfig | None = None, frame_s: float = 0.08):
        self.config = config or AdmissionConfig()
        self.frame_s = frame_s
        self.model = StepModel(self.config)
        self.reason = ""  # why admission holds ("" while open)
        self._last_admit_at: float | None = None
        self._drain_busy_s = 0.0  # time the recent admissions of a backlog took (decayed)
        self._drain_count = 0.0  # and their number (decayed alike)
        # The admission events (the steps that started some) among them, decayed alike: how long
        # a backlog normally goes without an admission, the yardstick of a stall.
        self._event_count = 0.0
        # When the backlog's admissions of the last `_RECENT_S` happened: a stall lowers the drain
        # rate no further than their count over that time (`drain_per_s`).
        self._recent: deque[float] = deque()
        self._idle_since: float | None = None  # since when the talker is idle (`note_queue`)
        # The decoder's cost on this GPU: the flag's prior until code2wav publishes its own.
        self.decoder_frame_s = self.config.decoder_frame_s
        self.decoder_call_load = 0.0  # busy fraction of the decoder's per-call cost
        self.decoder_measured = False

    def observe_decoder(self, frame_s: float, call_s: float = 0.0, calls_per_s: float = 0.0) -> bool:
        """code2wav's published cost on its GPU: seconds per decoded frame, per decode call, and
        its calls per second. Counted only when the decoder shares this GPU (returns whether it
        was); a negative or non-finite figure is an error. Safe from another thread than the
        engine's: plain float stores, and a plan that sees one new figure beside an old one errs
        by one update."""
        for name, value in (("frame_s", frame_s), ("call_s", call_s), ("calls_per_s", calls_per_s)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"decoder {name} must be finite and >= 0, got {value!r}")
        if not self.config.decoder_shares_gpu:
            return False
        self.decoder_frame_s = frame_s
        self.decoder_call_load = min(call_s * calls_per_s, 1.0)
        self.decoder_measured = True
        return True

    def frame_gpu_s(self, num_streams: int) -> float:
        """GPU time of one frame of `num_streams` streams for both engines together: the frame
        step and, when the decoder shares the GPU, its decode of those frames and its per-call
        share of a frame (no prefill); with `engine_costs` "overlap", the longer of the two."""
        n = max(num_streams, 0)
        decode = n * self.decoder_frame_s + self.decoder_call_load * self.frame_s
        if self.config.engine_costs == "overlap":
            return max(self.model.predict(n), decode)
        return self.model.predict(n) + decode

    def load(self, num_streams: int, mean_stream_s: float | None = None) -> float:
        """Predicted busy fraction of the GPU with `num_streams` running in steady state: their
        frame steps once a frame, the prefills of the streams replacing those that end, and their
        decode when the decoder shares the GPU; the two engines' loads summed, or with `engine_costs`
        "overlap" the busier engine's."""
        n = max(num_streams, 0)
        (talker_fixed, talker), (decoder_fixed, decoder) = self._engine_loads(mean_stream_s)
        loads = (talker_fixed + n * talker, (decoder_fixed if n else 0.0) + n * decoder)
        return max(loads) if self.config.engine_costs == "overlap" else sum(loads)

    def _engine_loads(self, mean_stream_s: float | None) -> tuple[tuple[float, float], tuple[float, float]]:
        """(fixed, per stream) busy fraction of the talker (its frame step's base; a stream's
        steps and the prefill of the stream replacing it) and of the decoder on this GPU (its
        per-call share; a stream's decode): what `load` and `capacity` both weigh."""
        cfg, m = self.config, self.model
        length = mean_stream_s if mean_stream_s and mean_stream_s > 0 else cfg.default_stream_s
        talker = (m.base_s / self.frame_s, m.per_stream_s / self.frame_s + m.prefill_request_s / length)
        return talker, (self.decoder_call_load, self.decoder_frame_s / self.frame_s)

    def allows(
        self,
        num_running: int,
        behind: int,
        mature: int,
        mean_stream_s: float | None = None,
        prefill_pending: int = 0,
        prefill_room: float = math.inf,
        positions: int = 0,
    ) -> bool:
        """May one more stream (of `positions` prompt positions) start now, beside `num_running`
        of which `behind` of the `mature` ones (with audio) are short of it? `mean_stream_s`: the
        running streams' mean length; `prefill_pending`: prompt positions admitted and not yet
        prefilled, `prefill_room`: the positions the next step may prefill."""
        if num_running == 0:
            self.reason = ""
            return True
        cfg = self.config
        if prefill_pending > 0 and prefill_pending + positions > prefill_room:
            self.reason = (
                f"{prefill_pending} prompt positions wait for their prefill, and the next step "
                f"prefills at most {prefill_room:.0f}"
            )
            return False
        if cfg.max_load > 0:
            load = self.load(num_running + 1, mean_stream_s)
            if load > cfg.max_load:
                self.reason = (
                    f"{num_running + 1} streams would keep the engine busy {load:.0%} of the time "
                    f"(frame steps, the prefills replacing ending streams and, on a shared GPU, "
                    f"their decode), over {cfg.max_load:.0%}"
                )
                return False
        if cfg.max_duty > 0:
            step = self.model.predict(num_running + 1)
            if step > cfg.max_duty * self.frame_s:
                self.reason = (
                    f"a step of {num_running + 1} streams would take {step * 1e3:.1f} ms, over "
                    f"{cfg.max_duty:.0%} of a {self.frame_s * 1e3:.0f} ms frame"
                )
                return False
        if cfg.max_behind_fraction > 0 and mature and behind > cfg.max_behind_fraction * mature:
            self.reason = f"{behind} of {mature} streams are short of audio"
            return False
        self.reason = ""
        return True

    def capacity(self, mean_stream_s: float | None = None) -> int | None:
        """The most streams that may run at once under the duty and load bounds (None: no bound)."""
        cfg, m = self.config, self.model
        caps = []
        if cfg.max_duty > 0 and m.per_stream_s > 0:
            caps.append(int((cfg.max_duty * self.frame_s - m.base_s) / m.per_stream_s))
        if cfg.max_load > 0:
            (talker_fixed, talker), (decoder_fixed, decoder) = self._engine_loads(mean_stream_s)
            if cfg.engine_costs == "overlap":  # each engine under the bound on its own
                for per_stream, fixed in ((talker, talker_fixed), (decoder, decoder_fixed)):
                    if per_stream > 0:
                        caps.append(int((cfg.max_load - fixed) / per_stream))
            elif talker + decoder > 0:
                caps.append(int((cfg.max_load - talker_fixed - decoder_fixed) / (talker + decoder)))
        return max(1, min(caps)) if caps else None

    def observe_admit(self, now: float, submitted_at: float | None = None, backlog: bool = True) -> None:
        """One request started: update the drain rate (admissions per second).

        The drain rate is how fast a backlog empties, so each admission counts the time since the
        previous one or since it was submitted, whichever is later: a request that found no queue
        started at once and says nothing about a slow queue (the gap between two waves of
        requests is not a stalled queue). The rate is the admissions' count over the time they took,
        not an average of inverse gaps, so a step that admits sixteen at once and then pauses a
        frame gives sixteen per frame.

        `backlog` False: the request started alone, nobody waiting behind it and no other started
        with it. Its wait (a step or two from its submission) is no queue's drain time and is not
        counted: an idle talker's requests, one at a time and each started a step or two after its
        submission, measure 50-80 a second, and the next burst is then told that its 150th-250th
        request would wait past 3 s (an H100 stack after such a probe let in 142 of 768,
        2026-12-05; HISTORY.md)."""
        starts = [t for t in (self._last_admit_at, submitted_at) if t is not None]
        if starts and backlog:
            start = max(starts)
            # Decayed sums over about the last `_DRAIN_MEMORY` admissions: their count over the
            # time they took.
            keep = 1.0 - 1.0 / self._DRAIN_MEMORY
            self._drain_busy_s = self._drain_busy_s * keep + max(now - start, 0.0)
            self._drain_count = self._drain_count * keep + 1.0
            # Admission events (a step's admissions, within 1 ms) counted in the same window: the
            # time between events is the busy time over their count; with one admission an event
            # it is the time between admissions.
            last = self._last_admit_at
            first_of_event = last is None or now - last > self._SAME_EVENT_S
            self._event_count = self._event_count * keep + (1.0 if first_of_event else 0.0)
            self._recent.append(now)
            self._forget_before(now - self._RECENT_S)
        self._last_admit_at = now

    def note_queue(self, now: float, idle: bool) -> None:
        """After a plan: whether the talker is `idle` (nobody waits and the running streams leave
        room for more). The drain rate forgets its backlog once the talker has stayed idle
        `_FORGET_AFTER_S` (`_forget_stale`); a talker at capacity refusing every arrival at
        submission (its queue empty, its demand not) keeps it."""
        self._forget_stale(now)
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now

    def _forget_stale(self, now: float) -> None:
        """Forget the drain rate of a backlog gone for `_FORGET_AFTER_S`. A queue that forms later
        meets other running streams (a level's burst after a warm-up of short requests, a free
        GPU after a spell at capacity), and its own first admissions measure it; until then its
        waits come from the slots and the running streams' ends. Kept, a warm-up whose short
        prompts waited for the prefill room (one a step while the running streams, all about to
        end, had no slack) put a simulated H100's drain at 60 a second, and the next burst was
        refused 67 of 512. Forgotten at once whenever the queue empties, a Poisson overload (the
        queue empty between arrivals for milliseconds) lost the rate measured at capacity, and
        its refusals came after waiting, 0.1-0.6 s at p95, not at submission; so did one whose
        queue was empty because every arrival was refused at submission (`note_queue`)."""
        if self._idle_since is not None and now - self._idle_since >= self._FORGET_AFTER_S:
            self._drain_busy_s = self._drain_count = self._event_count = 0.0
            self._recent.clear()

    def _forget_before(self, when: float) -> None:
        recent = self._recent
        while recent and recent[0] < when:
            recent.popleft()

    def drain_per_s(self, now: float, waiting_since: float | None = None) -> float | None:
        """Admissions per second; while a request waits (`waiting_since`: when the oldest waiting
        one was submitted) and none started for longer than the mean gap, the rate decays (a
        stalled queue drains at 0). None: nothing measured since the talker was last idle for
        `_FORGET_AFTER_S` (`note_queue`)."""
        self._forget_stale(now)
        if self._drain_count == 0:
            return None
        gap = max(self._drain_busy_s / self._drain_count, 1e-4)
        if waiting_since is not None:
            last = self._last_admit_at if self._last_admit_at is not None else waiting_since
            stalled = now - max(waiting_since, last)
            # A stall is judged against the time between admission events, not between
            # admissions: a step that starts sixteen and runs 54 ms leaves 54 ms without an
            # admission, which is no stall. Judged per admission, a burst's requests arriving
            # mid-step were told the queue drains at 18 a second, not 300, and refused (an H100
            # stack, 2026-12-06: "56 requests wait to start, about 3.1 s").
            event_gap = max(self._drain_busy_s / self._event_count, 1e-4) if self._event_count else gap
            if stalled > event_gap:
                # No lower than the admissions of the last `_RECENT_S` over that time: a hold of
                # a few tenths of a second (prompts waiting for their prefill, a few young streams
                # short of audio) in a burst admitting 700 a second read as 90 a second, and an H100
                # stack refused 310 of a closed loop's 768 at once ("386 requests wait to start,
                # about 4.6 s") that then started within 1.6 s (HISTORY.md, fifth session of
                # 2026-12-07). A queue stalled for longer than that still decays.
                stalled_gap = gap * stalled / event_gap
                self._forget_before(now - self._RECENT_S)
                if self._recent:
                    stalled_gap = max(gap, min(stalled_gap, self._RECENT_S / len(self._recent)))
                gap = stalled_gap
        return 1.0 / gap

    def predicted_wait_s(
        self, queue_position: int, now: float, waiting_since: float | None = None
    ) -> float | None:
        """Seconds until a request at `queue_position` (0 = next) starts; None when unknown."""
        rate = self.drain_per_s(now, waiting_since)
        if rate is None or rate <= 0:
            return None
        return (queue_position + 1) / rate

    def retry_after_s(self, queue_len: int, now: float, waiting_since: float | None = None) -> int:
        """Whole seconds after which a refused request should retry (the queue's drain time)."""
        wait = self.predicted_wait_s(queue_len, now, waiting_since)
        if wait is None:
            wait = self.config.first_audio_budget_s or 1.0
        return max(1, min(60, math.ceil(wait)))
