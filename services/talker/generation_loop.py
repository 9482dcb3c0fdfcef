"""The generation loop: one dedicated thread drives the batched generator, never the asyncio loop.

Layers: it owns no scheduling of its own. The `DeadlineScheduler` (deadline.py) decides who
waits, runs and steps; the generator (the GraphEngine, qtts/engine/engine.py, or the eager
`EagerGenerator`) places and runs what it is given. This loop carries one to the other.

The asyncio side submits requests and cancellations; the thread asks the `DeadlineScheduler` for
each step's plan (requests to start or refuse, streams to skip, the prefill budget, or how long to
sleep), runs it on the generator, and hands the streams' frames to their sinks a chunk at a time:
the events of one step go to the event loop in one `loop.call_soon_threadsafe` (one wake-up per
step, not one per stream).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from qtts.request.errors import GenerationFailed, ResourceExhausted, TTSError, Unavailable
from qtts.serving.metrics import TalkerMetrics
from qtts.streams.chunk_plan import StartPlanner

from .admission_trace import AdmissionTrace
from .deadline import DeadlineScheduler, ScheduledRequest, StepPlan

log = logging.getLogger(__name__)


class BatchGenerator(Protocol):
    """What the engine needs of `qtts.model.EagerGenerator`: `add` with at most `max_batch`
    requests in it (the scheduler starts no more), `cancel`, `step`."""

    num_active: int
    max_batch: int

    def add(self, request_id: str, prompt: Any, sampling: Any, max_new_frames: int | None = None) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def step(self, skip: Any = ...) -> list[Any]: ...


@dataclass(frozen=True)
class Admitted:
    """The request entered the generator after waiting `queue_s` seconds."""

    queue_s: float


@dataclass(frozen=True)
class Frame:
    """Generated frames `index` .. `index + len(codes) - 1` (counted from 0): int16 codes
    [n, num_codebooks]. The engine hands a stream's frames on a whole chunk at a time once the
    stream's chunk plan is known (code2wav decodes no partial chunk), so the event loop wakes once
    per chunk, not once per frame; `step_s` is the time of the step that made the last one, and
    `made_at` (perf_counter) when that step ended."""

    index: int
    codes: np.ndarray
    step_s: float
    made_at: float = 0.0
    # The stream's playback clock restarts at its next chunk handed on (engine_process.py: the
    # front's copy of the clock learns it so).
    clock_restart: bool = False
    # The next frame waits for text that has not arrived: the stream's frames so far are all
    # there is for now, and go to code2wav to be decoded though their chunk is not complete.
    text_waiting: bool = False


@dataclass(frozen=True)
class Finished:
    """Generation ended: reason "stop", "length" or "frame_cap", after `num_frames` frames."""

    reason: str
    num_frames: int


@dataclass(frozen=True)
class Failed:
    """Generation failed for this request."""

    error: Exception


def _codes_to_numpy(codes: Sequence[Any]) -> list[np.ndarray]:
    if not codes:
        return []
    first = codes[0]  # one generator per engine: every step's codes have one type
    if isinstance(first, np.ndarray) and first.dtype == np.int16 and first.ndim == 1:
        return list(codes)  # the GraphEngine's rows, already one host array
    try:
        import torch

        if all(isinstance(c, torch.Tensor) for c in codes):
            # One device->host copy for the whole batch instead of one sync per stream.
            stacked = torch.stack([c.reshape(-1) for c in codes]).to("cpu", torch.int16).numpy()
            return list(stacked)
    except ImportError:  # pragma: no cover - torch is a runtime dependency
        pass
    return [np.asarray(c, dtype=np.int16).reshape(-1) for c in codes]


def _deliver(events: list[tuple[ScheduledRequest, Any]]) -> None:
    for req, ev in events:
        req.sink(ev)


def emit(events: list[tuple[ScheduledRequest, Any]]) -> None:
    """Hand events to their sinks: grouped per event loop, or directly for thread-safe sinks."""
    by_loop: dict[Any, list] = {}
    for req, ev in events:
        if req.loop is None:
            req.sink(ev)
        else:
            by_loop.setdefault(req.loop, []).append((req, ev))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _held_frames(req: ScheduledRequest, step_s: float) -> Frame:
    """The frames `req` holds, handed on. A stream that now waits for text is flushed by its
    session there (`FrameDelta.flush`) where its replica cuts its chunks at a flush: the plan the
    deadlines read (`frames_to_next_chunk`) is cut alike."""
    held, req.held_codes = req.held_codes, []
    waiting = req.waits_for_text()
    if waiting and req.chunk_plan is not None and req.cuts_at_flush:
        req.chunk_plan = req.chunk_plan.flushed(req.credit.generated)
    return Frame(
        req.credit.generated - len(held),
        np.stack(held),
        step_s,
        time.perf_counter(),
        text_waiting=waiting,
    )


def _count_prefix_lookups(generator: Any, metrics: TalkerMetrics, seen: tuple[int, int]) -> tuple[int, int]:
    """Move the engine's prefix-cache hit and miss counts (qtts/engine/prefix_cache.py) past
    `seen` into the metrics, and return them: only after steps that admitted prompts, two
    attribute reads."""
    cache = getattr(getattr(generator, "runner", None), "prefix_cache", None)
    if cache is None:
        return seen
    hits, misses = seen
    if cache.hits > hits:
        metrics.prefix_cache_lookups_total.labels("hit").inc(cache.hits - hits)
    if cache.misses > misses:
        metrics.prefix_cache_lookups_total.labels("miss").inc(cache.misses - misses)
    return cache.hits, cache.misses


def skipping_step(generator: Any) -> Any:
    """A `step(skip, prefill_budget)` function for `generator`.

    Uses the generator's own `step(skip=..., prefill_budget=...)` where it has them. Otherwise
    the skipped requests are hidden from the generator's `active` map for the one step (their KV
    slots stay allocated), so they neither advance nor sample; a generator without a prefill
    budget prefills as it always does.
    """
    try:
        params = inspect.signature(generator.step).parameters
    except (TypeError, ValueError):
        params = {}
    if "skip" in params and "prefill_budget" in params:
        return lambda skip, budget: generator.step(skip=skip, prefill_budget=budget)
    if "skip" in params:
        return lambda skip, budget: generator.step(skip=skip)

    def step(skip: set[str], budget: int | None) -> list[Any]:
        if not skip:
            return generator.step()
        active = generator.active
        hidden = {rid: active.pop(rid) for rid in skip if rid in active}
        try:
            return generator.step()
        finally:
            active.update(hidden)

    return step


class GenerationLoop:
    """Runs a `BatchGenerator` in its own thread under a `DeadlineScheduler`."""

    def __init__(
        self,
        generator: BatchGenerator,
        scheduler: DeadlineScheduler,
        metrics: TalkerMetrics,
        idle_wait_s: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
        device_failure: Callable[[BaseException], bool] | None = None,
        trace: AdmissionTrace | None = None,
    ):
        slots = getattr(generator, "max_batch", None)
        if isinstance(slots, int) and scheduler.max_batch > slots:
            # The generator has no queue of its own: every request started must find a slot.
            raise ValueError(
                f"the scheduler starts up to {scheduler.max_batch} streams, the generator holds {slots}"
            )
        self._clock = clock
        # The admission decisions, plan by plan, into a file (`--admission-trace`; None: off).
        self._trace = trace
        # Reports a fatal device error (qtts.serving.device_failure) and says whether it was one.
        self._device_failure = device_failure
        self._generator = generator
        self._step_fn = skipping_step(generator)
        self._scheduler = scheduler
        self._metrics = metrics
        # The admission-cost gauges' children, bound once rather than looked up every step.
        costs = metrics.admission_cost_seconds
        self._cost_gauges = tuple(
            costs.labels(c) for c in ("step_base", "step_per_stream", "prefill_request", "decoder_frame")
        )
        self._idle_wait_s = idle_wait_s
        self._cond = threading.Condition()
        self._pending_cancels: list[str] = []
        self._prefix_seen = (0, 0)  # the prefix cache's (hits, misses) already counted
        self._held = False
        self._stop = False
        self._thread: threading.Thread | None = None

    @property
    def generator(self) -> BatchGenerator:
        return self._generator

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="talker-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._trace is not None:
            self._trace.close()

    def stop_admitting(self) -> None:
        with self._cond:
            self._scheduler.admitting = False

    def submit(self, req: ScheduledRequest) -> None:
        """Queue a request (raises ResourceExhausted/Unavailable when it cannot be taken)."""
        with self._cond:
            try:
                self._scheduler.submit(req, self._clock())
            except ResourceExhausted:
                self._metrics.refused_total.inc()
                self._trace_refusal(0)
                raise
            self._update_gauges()
            self._cond.notify()

    def check_admission(self, ahead: int) -> None:
        """Raise the refusal a request would get now with `ahead` requests before it that are not
        submitted yet (their prompts are being built): refused before its own prompt is built."""
        with self._cond:
            refusal = self._scheduler.refusal(self._clock(), ahead)
            if isinstance(refusal, ResourceExhausted):
                self._metrics.refused_total.inc()
                self._trace_refusal(ahead)
        if refusal is not None:
            raise refusal

    def _trace_refusal(self, ahead: int) -> None:
        """A request refused at submission into the admission trace, with the wait the queue's
        drain predicted for it. Call with the lock held."""
        if self._trace is None:
            return
        s = self._scheduler
        now = self._clock()
        self._trace.refuse(
            now, ahead=ahead, running=s.num_running, waiting=s.num_waiting,
            predicted_wait_s=s.forecast.predicted_wait_s(now, ahead),
        )  # fmt: skip

    def headroom(self, ahead: int = 0) -> Any:
        """The room for new requests (forecast.Headroom), with `ahead` more not submitted yet."""
        with self._cond:
            now = self._clock()
            room = self._scheduler.forecast.headroom(now, ahead)
        if self._trace is not None:
            self._trace.room(
                now, ahead=ahead, start_now=room.start_now, accept=room.accept, running=room.running,
                waiting=room.waiting,
            )  # fmt: skip
        return room

    def cancel(self, request_id: str) -> None:
        """Drop a request wherever it is; a no-op when it already finished."""
        with self._cond:
            _, was_running = self._scheduler.remove(request_id)
            if was_running:
                self._pending_cancels.append(request_id)
            self._update_gauges()
            self._cond.notify()

    def grant(self, req: ScheduledRequest, frames_allowed_until: int) -> None:
        """Record code2wav credit for a request; wake the loop only when the stream was stopped
        for lack of it (every other grant changes nothing the next plan depends on, and a plan
        looks at every running stream)."""
        with self._cond:
            blocked = not req.credit.has_credit()
            if req.credit.grant(frames_allowed_until) and blocked:
                self._cond.notify()

    def clock_changed(self, req: ScheduledRequest, restarted: bool) -> None:
        """The asyncio side moved `req`'s playback clock: nothing to do, the scheduler reads the
        same object (an engine in another process is told)."""

    def release_prompt(self, prompt: Any) -> None:
        """A prompt that will not be submitted: nothing to free here (its tensors go with it)."""

    def text_appended(self) -> None:
        """Text arrived for a stream that may be waiting for it: wake the loop to plan again."""
        with self._cond:
            self._cond.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._cond:
            return self._scheduler.num_running, self._scheduler.num_waiting

    def start_counts(self) -> tuple[int, int, int]:
        """(streams without first audio yet, streams generating or waiting to, requests queued
        for at least `StartPlanner.BACKLOG_AGE_S`): how busy the talker is, for a new stream's
        chunk plan (qtts.streams.chunk_plan.StartPlanner)."""
        with self._cond:
            s = self._scheduler
            unheard = sum(1 for req in s.running.values() if req.first_audio_at is None)
            # The queue is in submission order.
            backlog = StartPlanner.backlog((req.submitted_at for req in s.waiting), self._clock())
            return s.num_waiting + unheard, s.num_waiting + s.num_running, backlog

    def _update_gauges(self, plan: StepPlan | None = None) -> None:
        s = self._scheduler
        self._metrics.active_streams.set(s.num_running)
        self._metrics.queue_depth.set(s.num_waiting)
        if plan is not None:
            self._metrics.paused_streams.set(plan.num_paused)
            self._metrics.text_waiting_streams.set(plan.num_text_waiting)
        if s.admission is not None:
            self._metrics.predicted_step_seconds.set(s.admission.model.predict(s.num_running))
            if plan is not None and plan.step:  # once a step that runs
                self._observe_admission(s.admission, s.num_running)
        reason = s.holding_reason
        held = bool(reason)
        if held and not self._held:
            self._metrics.admission_holds_total.inc()
            log.info("holding %d waiting requests: %s", s.num_waiting, reason)
        self._held = held
        self._metrics.admission_held.set(int(held))

    def _observe_admission(self, adm: Any, running: int) -> None:
        """The admission capacity of this step and the costs it comes from (metrics only)."""
        cap = adm.capacity(self._scheduler.forecast.mean_stream_s())
        if cap is not None:
            self._metrics.admission_capacity_streams.observe(cap)
            if running > cap:
                self._metrics.steps_over_capacity_total.inc()
        m = adm.model
        for gauge, value in zip(
            self._cost_gauges,
            (m.base_s, m.per_stream_s, m.prefill_request_s, adm.decoder_frame_s),
            strict=True,
        ):
            gauge.set(value)

    def _next_plan(self) -> tuple[list[str], StepPlan] | None:
        """Wait until there is something to do; None once stopped. Call with the lock held."""
        while True:
            cancels, self._pending_cancels = self._pending_cancels, []
            if self._stop:
                for rid in cancels:
                    self._call_generator(self._generator.cancel, rid)
                return None
            now = self._clock()
            plan = self._scheduler.plan(now)
            if cancels or plan.admitted or plan.refused or plan.step:
                return cancels, plan
            self._update_gauges(plan)
            timeout = self._idle_wait_s
            if plan.wake_at is not None:
                timeout = min(timeout, max(plan.wake_at - now, 0.0005))
            if self._scheduler.waiting:  # held-back requests are re-checked soon
                timeout = min(timeout, 0.02)
            self._cond.wait(timeout)

    def _run(self) -> None:
        """The engine thread: schedule, run the step, postprocess its outputs; until stopped."""
        while (scheduled := self._schedule()) is not None:
            cancels, plan = scheduled
            self._apply_plan(cancels, plan)
            if not plan.step:
                continue
            ran = self._run_step(plan)
            if ran is not None:
                self._postprocess(plan, *ran)

    def _schedule(self) -> tuple[list[str], StepPlan] | None:
        """The next plan, once there is something to do (None once stopped)."""
        with self._cond:
            nxt = self._next_plan()
            if nxt is None:
                return None
            _, plan = nxt
            for rid, req in self._scheduler.running.items():
                stalled = rid in plan.skip and not req.credit.has_credit()
                if stalled and not req.stalled:
                    self._metrics.credit_stalls_total.inc()
                req.stalled = stalled
            self._update_gauges(plan)
            if self._trace is not None and (plan.step or plan.admitted or plan.refused):
                self._trace_plan(plan)
        return nxt

    def _trace_plan(self, plan: StepPlan) -> None:
        """One plan into the admission trace. Call with the lock held."""
        s = self._scheduler
        adm = s.admission
        now = self._clock()
        fields: dict[str, Any] = {}
        if adm is not None:
            m = adm.model
            fields = {
                "capacity": s.forecast.capacity(),
                "step_base_s": m.base_s,
                "step_per_stream_s": m.per_stream_s,
                "prefill_request_s": m.prefill_request_s,
                "prefill_position_s": m.prefill_position_s,
                "decoder_frame_s": adm.decoder_frame_s,
                "decoder_call_load": adm.decoder_call_load,
                "drain_per_s": adm.drain_per_s(now, s.forecast.waiting_since()),
            }
        self._trace.plan(
            now, running=s.num_running, waiting=s.num_waiting, admitted=len(plan.admitted),
            refused=len(plan.refused), stepping=len(plan.stepping), prefill_budget=plan.prefill_budget,
            tightest_s=s.last_tightest_s if plan.step else None, reason=s.holding_reason, **fields,
        )  # fmt: skip

    def _apply_plan(self, cancels: list[str], plan: StepPlan) -> None:
        """Cancels, refusals and admissions before the step: an admitted request prefills in it."""
        for rid in cancels:
            self._call_generator(self._generator.cancel, rid)
        if plan.refused:
            emit([(req, Failed(err)) for req, err in plan.refused])
        for req in plan.admitted:
            self._add(req)

    def _call_generator(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            if not self._device_failed(exc):
                log.exception("generator %s%r failed", getattr(fn, "__name__", fn), args)

    def _device_failed(self, exc: BaseException) -> bool:
        """A fatal device error: nothing more is admitted, every running stream fails with
        UNAVAILABLE (another talker can serve it) and the process is on its way out."""
        if self._device_failure is None or not self._device_failure(exc):
            return False
        with self._cond:
            self._scheduler.admitting = False
        self._fail_all(Unavailable("the talker's GPU failed; retry the request"))
        return True

    def _add(self, req: ScheduledRequest) -> None:
        try:
            self._generator.add(req.request_id, req.prompt, req.sampling, req.max_new_frames)
        except Exception as exc:
            if self._device_failed(exc):  # the request was running: failed with the others
                return
            if isinstance(exc, TTSError):  # the request's own fault (e.g. too long): no traceback
                log.info("request %s not started: %s", req.request_id, exc)
            else:
                log.exception("could not add request %s to the generator", req.request_id)
            with self._cond:
                self._scheduler.remove(req.request_id)
                self._update_gauges()
            error = (
                exc if isinstance(exc, TTSError) else GenerationFailed(f"could not start generation: {exc}")
            )
            emit([(req, Failed(error))])
            return
        emit([(req, Admitted(self._clock() - req.submitted_at))])

    def _run_step(self, plan: StepPlan) -> tuple[list[Any], float, int] | None:
        """The generator's step: (its outputs, seconds, prompt positions it may have prefilled),
        or None when it failed (its streams are failed)."""
        stepping = plan.stepping
        # Prompt positions this step may prefill (an estimate: prefix-cache hits write fewer).
        prefill = sum(r.prefill_positions for r in stepping if not r.stepped)
        t0 = time.perf_counter()
        try:
            outputs = self._step_fn(plan.skip, plan.prefill_budget)
        except Exception as exc:
            if self._device_failed(exc):
                return None
            log.exception("generator step failed; failing the %d streams in it", len(stepping))
            self._fail_all(GenerationFailed(f"generation step failed: {exc}"))
            return None
        return outputs, time.perf_counter() - t0, prefill

    def _postprocess(self, plan: StepPlan, outputs: list[Any], step_s: float, prefill: int) -> None:
        """The step's measurements to the metrics and the admission model, then its frames and
        ends to the streams (frames a whole chunk at a time)."""
        stepping = plan.stepping
        (self._metrics.prefill_seconds if prefill else self._metrics.step_seconds).observe(step_s)
        began = self._clock() - step_s
        decoded = sum(1 for r in stepping if r.stepped)
        prompts = len(stepping) - decoded  # rows prefilling in this step
        budget = plan.prefill_budget if plan.prefill_budget is not None else prefill
        if self._scheduler.admission is not None:
            self._scheduler.admission.model.observe(max(decoded, 1), step_s, min(prefill, budget), prompts)
        if self._trace is not None:
            self._trace.step(
                began,
                batch=len(stepping),
                prompts=prompts,
                prefill_positions=min(prefill, budget),
                seconds=step_s,
            )
        self._metrics.batch_size.observe(len(stepping))
        events: list[tuple[ScheduledRequest, Any]] = []
        with self._cond:
            with_codes: list[tuple[ScheduledRequest, Any]] = []
            finished: list[tuple[ScheduledRequest, str]] = []
            for out in outputs:
                req = self._scheduler.running.get(out.request_id)
                if req is None:  # cancelled while the step ran
                    continue
                if not req.stepped:  # its prefill's step: how long it waited for it since admission
                    self._metrics.prefill_wait_seconds.observe(max(0.0, began - req.admitted_at))
                req.stepped = True
                if out.codes is not None:
                    with_codes.append((req, out.codes))
                if out.finished:
                    self._scheduler.remove(out.request_id)
                    finished.append((req, out.finish_reason or "stop"))
            ending = {req.request_id for req, _ in finished}
            for (req, _), codes in zip(with_codes, _codes_to_numpy([c for _, c in with_codes]), strict=True):
                req.held_codes.append(codes)
                req.credit.generated += 1
                if req.hand_on_now() or req.request_id in ending:
                    events.append((req, _held_frames(req, step_s)))
            for req, reason in finished:
                if req.held_codes:  # an end without a frame of its own (EOS) after held frames
                    events.append((req, _held_frames(req, step_s)))
                events.append((req, Finished(reason, req.credit.generated)))
            self._update_gauges()
        self._metrics.frames_total.inc(len(with_codes))
        if prefill:
            self._prefix_seen = _count_prefix_lookups(self._generator, self._metrics, self._prefix_seen)
        emit(events)

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            failed = list(self._scheduler.running.values())
            for req in failed:
                self._scheduler.remove(req.request_id)
            self._update_gauges()
        for req in failed:
            self._call_generator(self._generator.cancel, req.request_id)
        emit([(req, Failed(error)) for req in failed])
