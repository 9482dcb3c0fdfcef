"""The talker's GPU side in a process of its own, so the loop driving the GPU never shares a GIL
with the transport (`--engine-process`, on by default on CUDA).

In one process the engine thread shared the interpreter with the gRPC event loop (hundreds of
streams' frames, credits and audio) and the prompt thread: a step with a prefill took 40 ms
instead of about 13 while they were busy. Here the front (the talker's gRPC process) keeps the
transport: the callers' calls, speaker_cache, the code2wav streams and their credits. The engine
process holds the model, computes voice prompts, builds prompts and runs the `GenerationLoop`.

They talk over two pipes of pickled tuples (times are `time.perf_counter`, one clock for every
process of the host):

- front -> engine: `("call", id, name, args)` for prompt work and metrics, each answered by
  `("reply", id, ok, value)`; `("submit", request_id, prompt_key, sampling, max_new_frames,
  window)`, `("cancel", request_id)`, `("drop", prompt_key)`, `("grant", request_id, until,
  plan)`, `("clock", request_id, first_audio_at, delivered_s, restarted)`, `("wake",)`,
  `("stop_admitting",)`, `("stop",)`; grants and clocks of one event-loop turn go together as
  `("batch", [message, ...])`;
- engine -> front: `("ready", EngineFacts)` or `("start_failed", message)`, `("events",
  [(request_id, event), ...])` once per step, `("reply", ...)`, `("device_failed", message)`.

A prompt stays in the engine process: the front holds a `RemotePrompt` (its key, its reference
frames as host rows for code2wav, its token count).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from qtts.request.errors import ResourceExhausted, Unavailable

from .core import reference_rows
from .generation_loop import Failed, Finished, Frame, emit

log = logging.getLogger(__name__)

# Families the engine process reports that describe the process itself, not the talker: the
# front's own process_* / python_* series stand for the pod.
_PROCESS_FAMILIES = ("process_", "python_")

# Prompts built before one wait for the prompt stream: enough for a burst, few enough that the
# first of them is not held long behind the last.
MAX_BUILD_BATCH = 8


@dataclass(frozen=True)
class EngineFacts:
    """What the front needs of the loaded model, sent once the engine process is ready."""

    info: Any
    generation_defaults: Any
    voice_fingerprint: str
    max_text_positions: int | None
    pid: int


@dataclass
class RemotePrompt:
    """A prompt built and held in the engine process; `ref_codes_host` are its ICL reference
    frames as int16 rows (None without), `num_text_tokens` its target text's tokens."""

    key: str
    ref_codes_host: np.ndarray | None
    num_text_tokens: int
    build_s: float = 0.0  # the engine process's moving average of one build, as this one was done


def voice_to_wire(voice: Any) -> Any:
    """A VoicePrompt with numpy arrays instead of tensors: a tensor pickles through torch.save,
    an array as its bytes."""
    if voice is None:
        return None
    arrays = {n: t.numpy() for n in ("x_vector", "ref_codes") if (t := getattr(voice, n, None)) is not None}
    return replace(voice, **arrays)


def voice_from_wire(voice: Any) -> Any:
    if voice is None:
        return None
    import torch

    tensors = {
        n: torch.from_numpy(a)
        for n in ("x_vector", "ref_codes")
        if isinstance(a := getattr(voice, n, None), np.ndarray)
    }
    return replace(voice, **tensors)


def spec_to_wire(spec: Any) -> Any:
    voice = getattr(spec, "voice_prompt", None)
    return spec if voice is None else replace(spec, voice_prompt=voice_to_wire(voice))


def spec_from_wire(spec: Any) -> Any:
    voice = getattr(spec, "voice_prompt", None)
    return spec if voice is None else replace(spec, voice_prompt=voice_from_wire(voice))


# -- the engine process -------------------------------------------------------------------------


class _PipeLoop:
    """Stands in for an event loop in `generation_loop.emit`: one step's events, one message.

    The front keeps its own copy of each stream's playback clock; when the scheduler restarts a
    clock (text came back after the listener ran dry), the next frames say so, once."""

    def __init__(self, worker: _EngineWorker):
        self._worker = worker
        self.restarts_told: set[str] = set()

    def call_soon_threadsafe(self, _deliver: Callable, batch: list) -> None:
        events = []
        for req, ev in batch:
            if isinstance(ev, Frame) and req.clock_restart and req.request_id not in self.restarts_told:
                self.restarts_told.add(req.request_id)
                ev = replace(ev, clock_restart=True)
            events.append((req.request_id, ev))
        self._worker.emit(events)


class _EngineWorker:
    """The engine process's side: applies the front's commands to the loop and answers calls."""

    def __init__(self, conn_in: Any, conn_out: Any, config: Any, run_warm_up: bool):
        self._in = conn_in
        self._out = conn_out
        self._send_lock = threading.Lock()
        self.config = config
        self._run_warm_up = run_warm_up
        self._pipe_loop = _PipeLoop(self)
        self._prompts: dict[str, Any] = {}  # built, not yet submitted
        self._open: dict[str, Any] = {}  # text-open prompts still taking text
        self._requests: dict[str, Any] = {}  # request id -> ScheduledRequest
        self._prompt_of: dict[str, str] = {}  # request id -> prompt key
        # One thread builds every prompt, in arrival order, on a CUDA stream of its own; the
        # builds queued when it comes to them are built together and waited for once.
        self._prompt_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-prompt")
        self._builds: collections.deque[tuple[int, Any, float, float]] = collections.deque()
        self._stream: Any = None
        self._queued = 0  # prompt builds waiting for the prompt thread
        self._build_s = 0.0  # moving average of one build
        self._last_answer_at = 0.0  # when the last pipelined build was answered
        # Pipelined builds whose kernels were queued, not yet answered: (call, began, prompt, event).
        self._inflight: collections.deque[tuple[int, float, Any, Any]] = collections.deque()
        self.loop: Any = None
        self.bundle: Any = None

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self._out.send(message)

    def emit(self, events: list[tuple[str, Any]]) -> None:
        for rid, ev in events:
            if isinstance(ev, Finished | Failed):
                self._forget(rid)
        self.send(("events", events))

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._pipe_loop.restarts_told.discard(rid)
        key = self._prompt_of.pop(rid, None)
        if key is not None:
            self._open.pop(key, None)

    def start(self) -> EngineFacts:
        import torch

        from qtts.serving.grpc_server import settle_heap

        from . import model_setup
        from .generation_loop import GenerationLoop
        from .metrics_merge import engine_metrics
        from .warmup import warm_up

        self.bundle = bundle = model_setup.load_bundle(self.config)
        generator = model_setup.generator_factory_for(self.config)(bundle, self.config.max_batch)
        if self._run_warm_up:
            warm_up(bundle, generator)
        device = getattr(bundle, "device", None)
        if device is not None and torch.device(device).type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
        self.metrics = engine_metrics()
        self.loop = GenerationLoop(
            generator,
            model_setup.scheduler_for(self.config, generator),
            self.metrics,
            device_failure=self._fatal,
        )
        self.loop.start()
        fingerprint = getattr(bundle, "voice_encoder_fingerprint", None)
        settle_heap()
        return EngineFacts(
            info=bundle.info,
            generation_defaults=bundle.generation_defaults,
            voice_fingerprint=fingerprint() if fingerprint is not None else "",
            max_text_positions=getattr(generator, "max_text_positions", None),
            pid=os.getpid(),
        )

    def _fatal(self, exc: BaseException) -> bool:
        from qtts.serving.device_failure import DEVICE_FAILURE_EXIT_CODE, is_fatal_device_error

        if not is_fatal_device_error(exc):
            return False
        log.critical("unrecoverable device error in the engine process: %s", exc)
        try:
            self.send(("device_failed", f"{type(exc).__name__}: {exc}"))
        finally:
            # The loop fails its streams (their events go out first), then the process ends.
            timer = threading.Timer(0.5, os._exit, (DEVICE_FAILURE_EXIT_CODE,))
            timer.daemon = True
            timer.start()
        return True

    def serve(self) -> None:
        """Apply commands until "stop" or the front goes away (its end of the pipe closes)."""
        while True:
            try:
                message = self._in.recv()
            except (EOFError, OSError):
                log.info("the talker front went away: stopping the engine process")
                break
            kind = message[0]
            if kind == "stop":
                break
            try:
                self._apply(kind, message[1:])
            except Exception:  # noqa: BLE001 - one bad command must not end the engine
                log.exception("engine process: command %s failed", kind)
        self.loop.stop()
        self._prompt_thread.shutdown(wait=False, cancel_futures=True)

    def _apply(self, kind: str, args: tuple) -> None:
        if kind == "call":
            call_id, name, call_args = args
            if name == "metrics":  # answered at once, not behind the prompts
                self._answer(call_id, self._metrics_snapshot)
            elif name == "build_prompt":
                try:  # refused now rather than after the prompts ahead of it are built
                    self.loop.check_admission(self._queued)
                except Exception as exc:  # noqa: BLE001 - the caller gets the refusal
                    self.send(("reply", call_id, False, exc))
                    return
                self._queued += 1
                self._builds.append((call_id, *call_args))
                self._prompt_thread.submit(self._build_queued)
            else:
                self._prompt_thread.submit(self._answer, call_id, getattr(self, f"_call_{name}"), *call_args)
        elif kind == "submit":
            self._submit(*args)
        elif kind == "cancel":
            (rid,) = args
            self._forget(rid)
            self.loop.cancel(rid)
        elif kind == "drop":
            (key,) = args
            self._prompt_thread.submit(self._drop, key)  # after any build of it queued before
        elif kind == "grant":
            rid, until, plan = args
            req = self._requests.get(rid)
            if req is not None:
                if plan is not None:
                    req.chunk_plan = plan
                self.loop.grant(req, until)
        elif kind == "clock":
            rid, first_audio_at, delivered_s, restarted = args
            req = self._requests.get(rid)
            if req is not None:
                req.first_audio_at = first_audio_at  # before the flag: the engine thread reads both
                req.delivered_s = delivered_s
                if restarted:
                    req.clock_restart = False
                    self._pipe_loop.restarts_told.discard(rid)
        elif kind == "batch":
            (messages,) = args
            for message in messages:
                self._apply(message[0], message[1:])
        elif kind == "wake":
            self.loop.text_appended()
        elif kind == "stop_admitting":
            self.loop.stop_admitting()
        else:
            log.error("engine process: unknown command %r", kind)

    def _answer(self, call_id: int, fn: Callable, *args: Any) -> None:
        try:
            value, ok = fn(*args), True
        except Exception as exc:  # noqa: BLE001 - the caller gets the error
            value, ok = exc, False
        self._reply(call_id, ok, value)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        try:
            self.send(("reply", call_id, ok, value))
        except Exception as exc:  # noqa: BLE001 - e.g. an error that does not pickle
            self.send(("reply", call_id, False, RuntimeError(f"{type(value).__name__}: {value}; {exc}")))

    def _submit(self, rid: str, key: str, sampling: Any, max_new_frames: int | None, window: int) -> None:
        from .deadline import ScheduledRequest, StreamCredit

        prompt = self._prompts.pop(key, None)
        if prompt is None:
            self.emit([(rid, Failed(Unavailable("the prompt of this request is gone from the engine")))])
            return
        req = ScheduledRequest(
            request_id=rid,
            prompt=prompt,
            sampling=sampling,
            max_new_frames=max_new_frames,
            credit=StreamCredit(window=window),
            sink=lambda ev: None,  # events go out through the stand-in loop
            loop=self._pipe_loop,
            text=getattr(prompt, "text_feed", None),
        )
        self._requests[rid] = req
        self._prompt_of[rid] = key
        try:
            self.loop.submit(req)
        except Exception as exc:  # noqa: BLE001 - refused (or not serving): the stream's error
            self.emit([(rid, Failed(exc))])

    def _drop(self, key: str) -> None:
        self._prompts.pop(key, None)
        self._open.pop(key, None)

    def _on_stream(self, fn: Callable, *args: Any, wait: bool = True) -> Any:
        """`fn(*args)` on the prompt thread's CUDA stream, waited for unless `wait` is False (the
        engine reads the embeddings from its own stream, so someone must wait before it does)."""
        if self._stream is None:
            return fn(*args)
        import torch

        with torch.cuda.stream(self._stream):
            out = fn(*args)
        if wait:
            self._stream.synchronize()
        return out

    def _stored(self, prompt: Any) -> RemotePrompt:
        key = uuid.uuid4().hex
        self._prompts[key] = prompt
        return RemotePrompt(key, reference_rows(prompt), int(getattr(prompt, "num_text_tokens", 0) or 0))

    # Calls, run on the prompt thread in arrival order.
    def _build_queued(self) -> None:
        """Build the queued prompts and answer them, as `--prompt-builds` says."""
        if self.config.prompt_builds == "pipelined":
            self._build_pipelined()
        else:
            self._build_batch()

    def _build_batch(self) -> None:
        """Build the queued prompts (at most `MAX_BUILD_BATCH`), then wait for the prompt stream
        once and answer them: one wait for the GPU per batch, not per prompt, as a burst arrives."""
        batch = []
        while self._builds and len(batch) < MAX_BUILD_BATCH:
            batch.append(self._builds.popleft())
        if not batch:
            return  # built by an earlier call
        started = time.perf_counter()
        built: list[tuple[int, float, Any]] = []
        for call_id, spec, queued_at, budget_s in batch:
            began = time.perf_counter()
            try:
                built.append((call_id, began, self._start_build(spec, queued_at, budget_s, began)))
            except Exception as exc:  # noqa: BLE001 - this caller gets the error, the rest go on
                self._reply(call_id, False, exc)
        try:
            if self._stream is not None and built:
                self._stream.synchronize()  # the engine reads the embeddings from its own stream
        except Exception as exc:  # noqa: BLE001 - a device error fails every prompt of the batch
            for call_id, _, _ in built:
                self._reply(call_id, False, exc)
            return
        done = time.perf_counter()
        per_build = (done - started) / len(batch)  # the drain rate the refusals predict with
        self._build_s = per_build if self._build_s == 0 else self._build_s + 0.1 * (per_build - self._build_s)
        for call_id, began, prompt in built:
            self.metrics.observe_stage("build_prompt", done - began)
            remote = self._stored(prompt)
            remote.build_s = self._build_s
            self._reply(call_id, True, remote)

    def _build_pipelined(self) -> None:
        """Build up to `MAX_BUILD_BATCH` queued prompts, each followed by an event on the prompt
        stream, answering each prompt as soon as its event has passed, oldest first; with nothing
        left to build, wait for the GPU and answer the rest. So the thread waits for the GPU only
        when it has nothing to build: the build rate is the host's, not one batch per wait (which
        a busy GPU made one batch per engine step). Builds still in flight when this call stops
        at the cap are answered by the next call (one is queued for every build), and the calls
        queued beside them (voice prompts, text) get their turn in between."""
        started = 0
        while self._builds and started < MAX_BUILD_BATCH:
            call_id, spec, queued_at, budget_s = self._builds.popleft()
            started += 1
            began = time.perf_counter()
            try:
                prompt = self._start_build(spec, queued_at, budget_s, began)
                event = self._record_event()
            except Exception as exc:  # noqa: BLE001 - this caller gets the error, the rest go on
                self._reply(call_id, False, exc)
                continue
            self._inflight.append((call_id, began, prompt, event))
            self._answer_passed(wait=False)
        while self._inflight and not self._builds:
            self._answer_passed(wait=True)

    def _record_event(self) -> Any:
        """An event recorded on the prompt stream now (None without one: the build is done)."""
        if self._stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _answer_passed(self, wait: bool) -> None:
        """Answer the builds in flight whose events have passed, oldest first; with `wait`, wait
        for the oldest first. A device error fails every build in flight."""
        inflight = self._inflight
        try:
            if wait and inflight and inflight[0][3] is not None:
                inflight[0][3].synchronize()
            while inflight and (inflight[0][3] is None or inflight[0][3].query()):
                call_id, began, prompt, _ = inflight.popleft()
                done = time.perf_counter()
                # The drain rate the refusals predict with: the time between two answers while
                # builds queue, a build's own time when it came to an idle thread.
                per_build = done - max(began, self._last_answer_at)
                self._last_answer_at = done
                self._build_s = (
                    per_build if self._build_s == 0 else self._build_s + 0.1 * (per_build - self._build_s)
                )
                self.metrics.observe_stage("build_prompt", done - began)
                remote = self._stored(prompt)
                remote.build_s = self._build_s
                self._reply(call_id, True, remote)
        except Exception as exc:  # noqa: BLE001 - a device error fails every prompt in flight
            while inflight:
                self._reply(inflight.popleft()[0], False, exc)

    def _start_build(self, spec: Any, queued_at: float, budget_s: float, started: float) -> Any:
        """The prompt of `spec` with its kernels queued on the prompt stream (not waited for);
        refused when it waited past the first-audio budget to start."""
        self._queued -= 1
        self.metrics.observe_stage("prompt_queue", started - queued_at)
        if budget_s > 0 and started - queued_at > budget_s:
            raise ResourceExhausted(
                f"the talker is at capacity: the request waited {started - queued_at:.1f} s for its "
                f"prompt, past the {budget_s:g} s first-audio budget; retry later",
                max(1, round(self._queued * self._build_s)),
            )
        return self._on_stream(self.bundle.build_prompt, spec_from_wire(spec), wait=False)

    def _call_compute_voice_prompt(self, pcm: np.ndarray, ref_text: str | None, x_vector_only: bool) -> Any:
        return voice_to_wire(self.bundle.compute_voice_prompt(pcm, ref_text, x_vector_only))

    def _call_open_text(self, spec: Any) -> str:
        from qtts.model.open_text import OpenText

        key = uuid.uuid4().hex
        sync = self._stream.synchronize if self._stream is not None else (lambda: None)
        max_positions = getattr(self.loop.generator, "max_text_positions", None)
        self._open[key] = OpenText(
            self.bundle.prompt_builder, spec_from_wire(spec), max_positions=max_positions, sync=sync
        )
        return key

    def _call_push_text(self, key: str, piece: str, final: bool) -> tuple[RemotePrompt | None, int | None]:
        """(the prompt the first time it is built, else None; the text's tokens once it closed)."""
        text = self._open.get(key)
        if text is None:
            raise Unavailable("this request's text is gone from the engine")
        prompt = self._on_stream(text.push, piece, final)
        remote = None
        if prompt is not None:
            remote = self._stored(prompt)
            self._open[remote.key] = self._open.pop(key)  # its later text follows the prompt's key
        tokens = None
        if text.closed:
            feed = getattr(text.prompt, "text_feed", None)
            tokens = feed.num_text_tokens if feed is not None and feed.closed else None
        return remote, tokens

    def _call_held(self) -> dict[str, int]:
        """What the engine process holds for the front (after the prompt work queued before)."""
        return {"prompts": len(self._prompts), "open_texts": len(self._open), "requests": len(self._requests)}

    def _metrics_snapshot(self) -> list:
        return [
            family
            for family in self.metrics.registry.collect()
            if not family.name.startswith(_PROCESS_FAMILIES)
        ]


def engine_main(conn_in: Any, conn_out: Any, config: Any, run_warm_up: bool) -> None:
    """The engine process's body (spawned: CUDA cannot be forked).

    It ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and the front
    drains its streams before it sends "stop" (its end of the pipe closing ends this process
    too, whatever ended the front)."""
    import signal
    import sys

    from qtts.serving.grpc_server import configure_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    configure_logging(config.log_level, getattr(config, "log_format", None), service="talker-engine")
    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)
    worker = _EngineWorker(conn_in, conn_out, config, run_warm_up)
    try:
        facts = worker.start()
    except BaseException as exc:  # noqa: BLE001 - the front reports it and exits
        log.exception("the engine process could not start")
        try:
            conn_out.send(("start_failed", f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    worker.send(("ready", facts))
    worker.serve()
    os._exit(0)  # the loop's daemon threads and CUDA teardown need no orderly exit


# -- the front ----------------------------------------------------------------------------------


class EngineClient:
    """The front's handle on the engine process: `GenerationLoop`'s interface over the pipes,
    plus the prompt calls `RemoteBundle` makes. `on_lost(message)` is called once (from the reader
    thread) when the engine process fails its device or ends unasked; every stream then fails
    with UNAVAILABLE."""

    def __init__(
        self, config: Any, *, run_warm_up: bool = True, on_lost: Callable[[str], None] | None = None
    ):
        self._config = config
        self._run_warm_up = run_warm_up
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self._deferred: list[tuple] = []  # grants and clocks sent together at the loop turn's end
        self._ids = itertools.count(1)
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._requests: dict[str, Any] = {}  # request id -> the front's ScheduledRequest
        self._plan_sent: set[str] = set()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._process: Any = None
        self._cmd: Any = None
        self._reader: threading.Thread | None = None
        self._lost: str | None = None
        self._stopping = False
        self.facts: EngineFacts | None = None
        self.generator: Any = None  # what core reads of the generator: max_text_positions

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> EngineFacts:
        """Spawn the engine process and wait until its model is loaded (blocking: call it off the
        event loop). Raises Unavailable when it cannot start."""
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        evt_recv, evt_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=engine_main,
            args=(cmd_recv, evt_send, self._config, self._run_warm_up),
            name="talker-engine",
            daemon=True,
        )
        self._process.start()
        cmd_recv.close()
        evt_send.close()
        self._cmd = cmd_send
        self._reader = threading.Thread(
            target=self._read, args=(evt_recv,), name="engine-reader", daemon=True
        )
        self._reader.start()
        self.facts = self._ready.result()
        self.generator = _GeneratorFacts(self.facts.max_text_positions)
        log.info("engine process %d ready", self.facts.pid)
        return self.facts

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopping = True
        try:
            self._send(("stop",))
        except Unavailable:
            pass
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(1.0)

    @property
    def alive(self) -> bool:
        return self._lost is None and self._process is not None and self._process.is_alive()

    # -- GenerationLoop's interface ----------------------------------------------------------
    def submit(self, req: Any) -> None:
        self._requests[req.request_id] = req
        self._send(
            ("submit", req.request_id, req.prompt.key, req.sampling, req.max_new_frames, req.credit.window)
        )

    def cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._plan_sent.discard(request_id)
            self._send_quietly(("cancel", request_id))

    def grant(self, req: Any, frames_allowed_until: int) -> None:
        req.credit.grant(frames_allowed_until)
        plan = None
        if req.chunk_plan is not None and req.request_id not in self._plan_sent:
            self._plan_sent.add(req.request_id)
            plan = req.chunk_plan
        self._defer(("grant", req.request_id, frames_allowed_until, plan))

    def clock_changed(self, req: Any, restarted: bool) -> None:
        self._defer(("clock", req.request_id, req.first_audio_at, req.delivered_s, restarted))

    def release_prompt(self, prompt: Any) -> None:
        key = getattr(prompt, "key", None)
        if key is not None:
            self._send_quietly(("drop", key))

    def text_appended(self) -> None:
        self._send_quietly(("wake",))

    def stop_admitting(self) -> None:
        self._send_quietly(("stop_admitting",))

    def start_counts(self) -> tuple[int, int]:
        """As GenerationLoop.start_counts, from the requests this front submitted: the front
        keeps their playback clocks."""
        live = list(self._requests.values())  # one C-level copy: the reader thread pops from it
        return sum(1 for req in live if req.first_audio_at is None), len(live)

    # -- calls --------------------------------------------------------------------------------
    def call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """Run `name` in the engine process and return its value (blocking: off the event loop)."""
        return self.call_async(name, *args).result(timeout)

    def call_async(self, name: str, *args: Any) -> concurrent.futures.Future:
        """Run `name` in the engine process; its value (or error) arrives on the future."""
        call_id = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        future.add_done_callback(lambda _: self._calls.pop(call_id, None))
        try:
            self._send(("call", call_id, name, args))
        except Unavailable as exc:
            future.set_exception(exc)
        return future

    def abandon(self, future: concurrent.futures.Future) -> None:
        """The caller no longer wants `future`'s value: a prompt it carries is freed, whether it
        arrives later or arrived just before the caller gave up."""
        if future.cancel() or future.cancelled():
            return  # the reply, when it comes, finds no caller and frees it (`_read`)
        try:
            value = future.result(timeout=0)
        except Exception:  # noqa: BLE001 - an error carries no prompt
            return
        self._drop_unclaimed(value)

    def metrics_snapshot(self) -> list:
        if not self.alive:
            return []
        try:
            return self.call("metrics", timeout=2.0)
        except (concurrent.futures.TimeoutError, Unavailable):
            log.warning("the engine process did not report its metrics within 2 s")
            return []

    # -- transport ----------------------------------------------------------------------------
    def _send(self, message: tuple | None) -> None:
        """Send `message` (None: only the deferred ones), after the deferred messages before it."""
        if self._lost is not None or self._cmd is None:
            raise Unavailable(f"the talker's engine is not running: {self._lost or 'not started'}")
        try:
            with self._send_lock:
                if self._deferred:
                    batch, self._deferred = self._deferred, []
                    self._cmd.send(("batch", batch))
                if message is not None:
                    self._cmd.send(message)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"the talker's engine process is gone: {exc}") from exc

    def _defer(self, message: tuple) -> None:
        """Send `message` with the others of this event-loop turn, as one pipe message: credit
        grants and playback clocks come for hundreds of streams a second, and each message costs
        the engine process's threads a receive and an unpickle under their GIL. Off an event loop
        it goes at once; any message sent directly goes after the deferred ones."""
        if self._lost is not None:
            return  # every stream fails with the engine: its grants go nowhere
        with self._send_lock:
            self._deferred.append(message)
            first = len(self._deferred) == 1
        if not first:
            return
        try:
            asyncio.get_running_loop().call_soon(self._send_quietly, None)
        except RuntimeError:  # no event loop in this thread
            self._send_quietly(None)

    def _send_quietly(self, message: tuple | None) -> None:
        """For messages whose loss the stream notices otherwise (its Failed event)."""
        try:
            self._send(message)
        except Unavailable:
            pass

    def _read(self, conn: Any) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "events":
                self._dispatch(message[1])
            elif kind == "reply":
                _, call_id, ok, value = message
                future = self._calls.get(call_id)
                if future is not None and not future.done():
                    (future.set_result if ok else future.set_exception)(value)
                elif ok:  # its caller went away (cancelled): a prompt built for it is freed
                    self._drop_unclaimed(value)
            elif kind == "ready":
                self._ready.set_result(message[1])
            elif kind == "start_failed":
                self._ready.set_exception(Unavailable(f"the talker's engine could not start: {message[1]}"))
            elif kind == "device_failed":
                self._lose(f"the engine process's GPU failed: {message[1]}")
        code = self._process.exitcode if self._process is not None else None
        if self._process is not None:
            self._process.join(2.0)
            code = self._process.exitcode
        self._lose(f"the engine process ended (exit code {code})")

    def _drop_unclaimed(self, value: Any) -> None:
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, RemotePrompt):
                self._send_quietly(("drop", item.key))

    def _dispatch(self, events: list[tuple[str, Any]]) -> None:
        delivered = []
        for rid, ev in events:
            req = self._requests.get(rid)
            if req is None:  # cancelled meanwhile
                continue
            if isinstance(ev, Finished | Failed):
                self._requests.pop(rid, None)
                self._plan_sent.discard(rid)
            delivered.append((req, ev))
        emit(delivered)

    def _lose(self, message: str) -> None:
        if self._lost is not None:
            return
        self._lost = message
        if not self._ready.done():
            self._ready.set_exception(Unavailable(message))
        error = Unavailable(f"{message}; retry the request")
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
        failed, self._requests = self._requests, {}
        emit([(req, Failed(error)) for req in failed.values()])
        if self._stopping:
            return
        log.critical("%s", message)
        if self._on_lost is not None:
            self._on_lost(message)


@dataclass(frozen=True)
class _GeneratorFacts:
    max_text_positions: int | None


class RemoteOpenText:
    """`qtts.model.open_text.OpenText` of the engine process, as the front's core uses it."""

    def __init__(self, engine: EngineClient, spec: Any):
        self._engine = engine
        self._spec = spec
        self._key: str | None = None  # the engine process's key of this text, once opened
        self._prompt: RemotePrompt | None = None
        self.text = ""
        self.closed = False

    def push(self, piece: str, final: bool = False) -> RemotePrompt | None:
        """As OpenText.push (blocking: the core calls it on its prompt thread)."""
        if self._key is None:  # opened with the first piece, not on the event loop
            self._key = self._engine.call("open_text", self._spec)
        prompt, tokens = self._engine.call("push_text", self._key, piece, final)
        self.text += piece
        self.closed = final
        if prompt is not None:
            self._prompt = prompt
            self._key = prompt.key
        if tokens is not None and self._prompt is not None:
            self._prompt.num_text_tokens = tokens
        return prompt

    @property
    def key(self) -> str | None:
        return self._key

    def abandon(self) -> None:
        """The request ended before its prompt was built: free the text held for it."""
        if self._key is not None and self._prompt is None:
            self._engine.release_prompt(self)


class RemoteBundle:
    """What the front's core and voice resolver use of a `TalkerBundle`, served by the engine
    process: the prompt it builds stays there."""

    device = None  # no GPU work in the front

    def __init__(self, engine: EngineClient, facts: EngineFacts):
        self._engine = engine
        self.info = facts.info
        self.generation_defaults = facts.generation_defaults
        self._fingerprint = facts.voice_fingerprint

    def voice_encoder_fingerprint(self) -> str:
        return self._fingerprint

    def compute_voice_prompt(self, pcm_24k: np.ndarray, ref_text: str | None, x_vector_only: bool) -> Any:
        return voice_from_wire(self._engine.call("compute_voice_prompt", pcm_24k, ref_text, x_vector_only))

    def abandon_build(self, future: concurrent.futures.Future) -> None:
        self._engine.abandon(future)

    def build_prompt_async(self, spec: Any, queued_at: float, budget_s: float) -> concurrent.futures.Future:
        """The prompt of `spec`, built in the engine process's prompt queue: the queue, its
        first-audio budget and its timing are the engine process's, not a thread's here."""
        return self._engine.call_async("build_prompt", spec_to_wire(spec), queued_at, budget_s)

    def open_text(self, spec: Any) -> RemoteOpenText:
        return RemoteOpenText(self._engine, spec_to_wire(spec))


def engine_process_on(config: Any) -> bool:
    """Whether `config` runs the engine in a process of its own (auto: on a CUDA device)."""
    if config.engine_process == "auto":
        return str(config.device).startswith("cuda")
    return config.engine_process == "on"


__all__ = [
    "EngineClient",
    "EngineFacts",
    "RemoteBundle",
    "RemoteOpenText",
    "RemotePrompt",
    "engine_main",
    "engine_process_on",
]
