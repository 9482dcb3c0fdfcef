"""A simulated clock for the talker's scheduler: a batched engine, code2wav chunks, listeners.

The engine's step costs `base_s + per_stream_s * rows` plus `prefill_position_s` per prompt
position prefilled in it and `prefill_step_s` once if it prefilled any (prefill honours the scheduler's per-step budget, chunked as the graph
engine does). A stream's frames reach its listener a chunk at a time (code2wav's default plan
unless one is given), `decode_s` after the chunk's last frame. Each listener starts playing
when its first chunk arrives and measures underruns as the benchmark client does.

With `decoder_frame_s` the decoder shares the GPU: each chunk's frames cost that much GPU time
per frame (and `decoder_call_s` once per step that decodes any) after the step that finished them,
before the next step can run, and the talker's own step measurement does not see it (as a talker
on a GPU shared with code2wav measures its steps). With `publish_decoder_cost`, code2wav's
`DecodeCost` measures those decode calls and admission hears its estimate after each one, as the
talker hears it on code2wav's credit grants; with `calibrate_decoder` (the default) the estimate
starts from code2wav's start-up calibration, as a replica's does. With `decoder_in_steps` the
talker's step measurement does see it: each decode call's GPU time is counted into the next step's
measured time, as a talker measures its steps beside code2wav under MPS, where a step waits for the
decoder's kernels (the engines still take turns: no overlap is gained).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from qtts.streams.chunk_plan import ChunkPlan, StartPlanner
from services.code2wav.decode_cost import CALIBRATION_REPEATS, DecodeCost, calibration_calls
from services.talker.deadline import DeadlineScheduler, ScheduledRequest, StreamCredit

FRAME_S = 0.08


@dataclass
class Cost:
    base_s: float = 0.004
    per_stream_s: float = 0.0002
    prefill_position_s: float = 0.00001
    decode_s: float = 0.005
    # What a step with any prefill costs on top (in the stack about 30 ms, whatever its size).
    prefill_step_s: float = 0.0
    # GPU time the decoder takes per frame of a chunk, on the GPU the engine steps on (0: elsewhere).
    decoder_frame_s: float = 0.0
    decoder_call_s: float = 0.0


@dataclass
class Listener:
    """One stream as its client hears it."""

    request_id: str
    arrived_at: float
    frames: int
    prompt_positions: int
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, frames)
    refused: bool = False
    refused_at: float | None = None
    prefilled: int = 0
    finished_at: float | None = None

    @property
    def ttfa_s(self) -> float | None:
        return self.chunks[0][0] - self.arrived_at if self.chunks else None

    def max_underrun_s(self) -> float:
        """The benchmark client's definition: playback starts at the first chunk, no pre-roll."""
        if not self.chunks:
            return 0.0
        t0 = self.chunks[0][0]
        worst, before = 0.0, 0
        for t, n in self.chunks:
            worst = max(worst, (t - t0) - before * FRAME_S)
            before += n
        return max(worst, 0.0)


def _prompt(positions: int) -> SimpleNamespace:
    return SimpleNamespace(embeds=np.zeros((positions, 1), dtype=np.float32))


def simulate(
    scheduler: DeadlineScheduler,
    arrivals: list[tuple[float, int, int]],
    cost: Cost,
    *,
    closed_loop: int = 0,
    until_s: float = 60.0,
    plan: ChunkPlan | Callable[..., ChunkPlan] | None = None,
    retry_refused_s: float | None = None,
    publish_decoder_cost: bool = False,
    calibrate_decoder: bool = True,
    decoder_in_steps: bool = False,
) -> list[Listener]:
    """Run `arrivals` (time, frames, prompt positions) to completion or `until_s`.

    With `closed_loop` = n, every finished request is replaced at once by one like it, until
    n of them have been replaced; with `retry_refused_s` too, so is every refused one, that long
    after its refusal (a closed-loop client sends its next request when told no).

    `plan` is every stream's chunk plan, or a function that picks a stream's plan when it arrives
    from how many streams are starting then (submitted, first audio not yet heard) and how many
    are generating or waiting to (and how many of those queue: `_starting_running`); by default the talker's own choice (`StartPlanner`, fed with the
    simulated steps and trips through code2wav)."""
    planner = StartPlanner()
    if plan is None:
        plan_for = lambda *counts: planner.plan(*counts) or ChunkPlan()  # noqa: E731
    else:
        plan_for = plan if callable(plan) else (lambda *_counts: plan)
    pending = sorted(arrivals)
    listeners: dict[str, Listener] = {}
    reqs: dict[str, ScheduledRequest] = {}
    deliveries: list[tuple[float, int, str, int, float]] = []  # (time, seq, rid, frames, audio s)
    seq = 0
    replaced = 0
    now = 0.0
    unseen_s = 0.0  # the last decode call's GPU time, for the next step's measurement to hold
    adm = scheduler.admission
    # Refitted after every call: code2wav refits at most every 50 ms of its clock to spare its loop.
    decoder = DecodeCost(refit_s=0.0) if publish_decoder_cost else None
    if decoder is not None and calibrate_decoder and adm is not None:
        # As code2wav's start-up does (Code2WavCore.calibrate): one frame, one chunk, a wide batch.
        for _ in range(CALIBRATION_REPEATS):
            for streams, frames in calibration_calls(16, 64):
                decoder.calibrate(
                    streams * frames, cost.decoder_call_s + streams * frames * cost.decoder_frame_s
                )
        est = decoder.estimate()
        adm.observe_decoder(est.frame_s, est.call_s, est.calls_per_s)

    def arrive(t: float, frames: int, positions: int) -> None:
        rid = f"r{len(listeners)}"
        lis = Listener(rid, t, frames, positions)
        listeners[rid] = lis
        req = ScheduledRequest(
            rid,
            _prompt(positions),
            None,
            frames,
            StreamCredit(window=10**9, granted_until=10**9),
            sink=lambda ev: None,
            chunk_plan=plan_for(*_starting_running(reqs, scheduler, t)),
        )
        try:
            scheduler.submit(req, t)
        except Exception:  # noqa: BLE001 - refusals are the outcome being measured
            lis.refused, lis.refused_at = True, t
            replace_refused(lis, t)
            return
        reqs[rid] = req

    def replace_refused(lis: Listener, t: float) -> None:
        nonlocal replaced
        if retry_refused_s is not None and replaced < closed_loop:
            replaced += 1
            pending.append((t + retry_refused_s, lis.frames, lis.prompt_positions))
            pending.sort()

    while now < until_s:
        while pending and pending[0][0] <= now:
            arrive(*pending.pop(0))
        while deliveries and deliveries[0][0] <= now:
            t, _, rid, frames, audio_s = heapq.heappop(deliveries)
            lis = listeners[rid]
            lis.chunks.append((t, frames))
            req = reqs.get(rid)
            if req is not None:
                if req.first_audio_at is None:
                    req.first_audio_at = t
                req.delivered_s = audio_s
        step = scheduler.plan(now)
        for req, _ in step.refused:
            listeners[req.request_id].refused = True
            listeners[req.request_id].refused_at = now
            reqs.pop(req.request_id, None)
            replace_refused(listeners[req.request_id], now)
        if step.step:
            budget = step.prefill_budget if step.prefill_budget is not None else math.inf
            prefill = 0
            decoding = []
            for req in step.stepping:
                lis = listeners[req.request_id]
                if lis.prefilled < lis.prompt_positions:
                    n = int(min(lis.prompt_positions - lis.prefilled, max(budget - prefill, 0)))
                    lis.prefilled += n
                    prefill += n
                    if lis.prefilled < lis.prompt_positions:
                        continue  # still prefilling: no frame this step
                decoding.append(req)
            rows = len(decoding)
            dt = cost.base_s + cost.per_stream_s * rows + cost.prefill_position_s * prefill
            dt += cost.prefill_step_s if prefill else 0.0
            old = sum(1 for r in decoding if r.stepped)
            now += dt
            planner.observe_step(dt)
            if adm is not None:
                adm.model.observe(max(old, 1), dt + unseen_s, prefill)
            unseen_s = 0.0
            decoded_frames = 0
            for req in decoding:
                req.stepped = True
                req.credit.generated += 1
                g = req.credit.generated
                lis = listeners[req.request_id]
                end = req.chunk_plan.end_at_or_below(g)
                if end == g or g == lis.frames:
                    first = sum(n for _, _, r, n, _ in deliveries if r == req.request_id)
                    done = sum(n for _, n in lis.chunks) + first
                    seq += 1
                    decoded_frames += g - done
                    # The decoder's GPU work of the chunks so far this step runs before this one.
                    gpu_s = cost.decoder_call_s + decoded_frames * cost.decoder_frame_s
                    # Every chunk's trip: the simulated decoder holds no chunk for company, so
                    # each trip is as a young stream's (the talker feeds its early chunks only).
                    planner.observe_hop(gpu_s + cost.decode_s)
                    heapq.heappush(
                        deliveries, (now + gpu_s + cost.decode_s, seq, req.request_id, g - done, g * FRAME_S)
                    )
                if g == lis.frames:
                    scheduler.remove(req.request_id)
                    lis.finished_at = now
                    if replaced < closed_loop:
                        replaced += 1
                        pending.append((now, lis.frames, lis.prompt_positions))
                        pending.sort()
            if decoded_frames:  # the GPU decodes before the next step, in one call
                call_s = cost.decoder_call_s + decoded_frames * cost.decoder_frame_s
                now += call_s
                if decoder_in_steps:
                    unseen_s = call_s
                if decoder is not None and adm is not None:
                    decoder.observe(decoded_frames, call_s, now)
                    est = decoder.estimate()
                    adm.observe_decoder(est.frame_s, est.call_s, est.calls_per_s)
        else:
            nxt = [until_s]
            if pending:
                nxt.append(pending[0][0])
            if deliveries:
                nxt.append(deliveries[0][0])
            if step.wake_at is not None:
                nxt.append(step.wake_at)
            if scheduler.waiting:  # held back by admission: the engine re-checks soon
                nxt.append(now + 0.005)
            if not scheduler.running and not scheduler.waiting and not pending and not deliveries:
                break
            now = max(min(nxt), now + 1e-6)
    return list(listeners.values())


def _starting_running(
    reqs: dict[str, ScheduledRequest], scheduler: DeadlineScheduler, now: float
) -> tuple[int, int, int]:
    """(streams starting: submitted, no first audio yet; streams generating or waiting to;
    requests queued for `StartPlanner.BACKLOG_AGE_S` or longer), as the talker counts them."""
    # From the scheduler's own sets, not every request ever made: an arrival's cost must not grow
    # with the run (a closed loop past capacity makes tens of thousands of them).
    live = [reqs[rid] for rid in scheduler.running if rid in reqs] + list(scheduler.waiting)
    before = now - StartPlanner.BACKLOG_AGE_S
    backlog = sum(1 for r in scheduler.waiting if r.submitted_at <= before)
    return sum(1 for r in live if r.first_audio_at is None), len(live), backlog
