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
  `("reply", id, ok, value)` (or several as `("replies", [(id, ok, value), ...])`); `("submit", request_id, prompt_key, sampling, max_new_frames,
  window)`, `("cancel", request_id)`, `("drop", prompt_key)`, `("grant", request_id, until,
  plan)`, `("clock", request_id, first_audio_at, delivered_s, restarted)`, `("wake",)`,
  `("stop_admitting",)`, `("stop",)`; grants and clocks of one event-loop turn go together as
  `("batch", [message, ...])`;
- engine -> front: `("ready", EngineFacts)` or `("start_failed", message)`, `("events",
  [(request_id, event), ...])` once per step, `("reply", ...)`, `("device_failed", message)`.

A prompt stays in the engine process: the front holds a `RemotePrompt` (its key, its reference
frames as host rows for code2wav, its token count).

Here: `_EngineWorker` applies the front's commands in the engine process; `engine_prompts` builds
the prompts, `engine_wire` holds what crosses the pipes, `engine_client` is the front's side.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from qtts.request.errors import Unavailable

from .core import reference_rows
from .engine_prompts import PromptBuilds
from .engine_wire import EngineFacts, RemotePrompt, spec_from_wire, voice_to_wire
from .generation_loop import Failed, Finished, Frame

log = logging.getLogger(__name__)

# Families the engine process reports that describe the process itself, not the talker: the
# front's own process_* / python_* series stand for the pod.
_PROCESS_FAMILIES = ("process_", "python_")

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
        self.builds = PromptBuilds(config.prompt_builds, self._reply, self._stored)
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
        from qtts.serving.startup import StartupPhases

        from . import model_setup
        from .generation_loop import GenerationLoop
        from .metrics_merge import engine_metrics
        from .warmup import warm_up

        phases = StartupPhases(None, "talker-engine")  # logged here, sent to the front
        with phases.phase("load the model"):
            self.bundle = bundle = model_setup.load_bundle(self.config)
        with phases.phase("build the engine (graph capture)"):
            generator = model_setup.generator_factory_for(self.config)(bundle, self.config.max_batch)
        if self._run_warm_up:
            with phases.phase("warm up"):
                warm_up(bundle, generator)
        device = getattr(bundle, "device", None)
        if device is not None and torch.device(device).type == "cuda":
            # High priority: a build's few small kernels go ahead of the frame step's queued
            # blocks instead of waiting behind a whole step (the GPU time they take is tiny).
            self.builds.stream = torch.cuda.Stream(device=device, priority=-1)
        self.metrics = self.builds.metrics = engine_metrics()
        self.builds.build = bundle.build_prompt
        self.builds.build_many = bundle.prompt_builder.build_many
        self.builds.reply_many = self._reply_many
        scheduler = model_setup.scheduler_for(self.config, generator)
        # Told code2wav's decode cost (`decoder_cost`) from this thread: a few floats the engine
        # thread reads, so a plan between two of the writes mixes old and new figures, harmlessly.
        self.admission = scheduler.admission
        self.loop = GenerationLoop(
            generator,
            scheduler,
            self.metrics,
            device_failure=self._fatal,
            trace=model_setup.admission_trace_for(self.config),
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
            startup=dict(phases.phases),
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
            elif name == "headroom":  # answered at once too: the gateways poll it
                self._answer(call_id, self.loop.headroom, self._ahead())
            elif name == "build_prompt":
                try:  # refused now rather than after the prompts ahead of it are built
                    self.loop.check_admission(self._ahead())
                except Exception as exc:  # noqa: BLE001 - the caller gets the refusal
                    self.send(("reply", call_id, False, exc))
                    return
                self.builds.add(call_id, *call_args)
                self._prompt_thread.submit(self.builds.build_queued)
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
            rid, until, plan, cuts_at_flush = args
            req = self._requests.get(rid)
            if req is not None:
                if plan is not None:
                    req.chunk_plan, req.cuts_at_flush = plan, cuts_at_flush
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
        elif kind == "decoder_cost":
            if self.admission is not None:
                self.admission.observe_decoder(*args)
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

    def _reply_many(self, replies: list[tuple[int, bool, Any]]) -> None:
        """Many answers in one message (one pipe write, one GIL release); one by one if some
        value does not pickle."""
        try:
            self.send(("replies", replies))
        except Exception:  # noqa: BLE001 - e.g. an error that does not pickle: each on its own
            for reply in replies:
                self._reply(*reply)

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

    def _ahead(self) -> int:
        """Requests on their way to the scheduler that it does not hold yet: prompts asked for and
        not yet answered, and prompts built and not yet submitted (the front submits a built
        prompt a pipe message later; counted only while building, a burst's requests were
        admitted for room the ones just built already took, and refused at their submission)."""
        return self.builds.pending + len(self._prompts)

    def _drop(self, key: str) -> None:
        self._prompts.pop(key, None)
        self._open.pop(key, None)

    def _stored(self, prompt: Any) -> RemotePrompt:
        key = uuid.uuid4().hex
        self._prompts[key] = prompt
        return RemotePrompt(key, reference_rows(prompt), int(getattr(prompt, "num_text_tokens", 0) or 0))

    def _call_compute_voice_prompt(self, pcm: np.ndarray, ref_text: str | None, x_vector_only: bool) -> Any:
        return voice_to_wire(self.bundle.compute_voice_prompt(pcm, ref_text, x_vector_only))

    def _call_open_text(self, spec: Any) -> str:
        from qtts.model.open_text import OpenText

        key = uuid.uuid4().hex
        stream = self.builds.stream
        sync = stream.synchronize if stream is not None else (lambda: None)
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
        prompt = self.builds.on_stream(text.push, piece, final)
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


__all__ = ["engine_main"]
