"""The talker front's side of the engine process (engine_process.py): `EngineClient` speaks
`GenerationLoop`'s interface over the pipes; `RemoteBundle` and `RemoteOpenText` are what the
front's core uses of the model, served there."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from qtts.request.errors import Unavailable
from qtts.streams.chunk_plan import StartPlanner

from .engine_process import engine_main
from .engine_wire import EngineFacts, RemotePrompt, spec_to_wire, voice_from_wire
from .generation_loop import Admitted, Failed, Finished, emit

log = logging.getLogger(__name__)


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
        # Request id -> when this front submitted it, until the engine admits it (or it ends).
        self._queued: dict[str, float] = {}
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

    KILL_WAIT_S = 15.0

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
                # A killed process ends, but tearing down its memory (a model, a CUDA context) can
                # take seconds on a loaded host: wait for it, so that a stopped front leaves no
                # engine behind (1 s was too short once on a 2-core CI machine under the suite).
                self._process.join(self.KILL_WAIT_S)

    @property
    def alive(self) -> bool:
        return self._lost is None and self._process is not None and self._process.is_alive()

    # -- GenerationLoop's interface ----------------------------------------------------------
    def submit(self, req: Any) -> None:
        self._check_alive()
        self._requests[req.request_id] = req
        self._queued[req.request_id] = time.monotonic()
        self._defer(
            ("submit", req.request_id, req.prompt.key, req.sampling, req.max_new_frames, req.credit.window)
        )

    def cancel(self, request_id: str) -> None:
        self._queued.pop(request_id, None)
        if self._requests.pop(request_id, None) is not None:
            self._plan_sent.discard(request_id)
            self._defer(("cancel", request_id))

    def grant(self, req: Any, frames_allowed_until: int) -> None:
        req.credit.grant(frames_allowed_until)
        plan = None
        if req.chunk_plan is not None and req.request_id not in self._plan_sent:
            self._plan_sent.add(req.request_id)
            plan = req.chunk_plan
        self._defer(("grant", req.request_id, frames_allowed_until, plan, req.cuts_at_flush))

    def clock_changed(self, req: Any, restarted: bool) -> None:
        self._defer(("clock", req.request_id, req.first_audio_at, req.delivered_s, restarted))

    def release_prompt(self, prompt: Any) -> None:
        key = getattr(prompt, "key", None)
        if key is not None:
            self._defer(("drop", key))

    def text_appended(self) -> None:
        self._send_quietly(("wake",))

    def stop_admitting(self) -> None:
        self._send_quietly(("stop_admitting",))

    def headroom_async(self) -> concurrent.futures.Future:
        """The engine's room for new requests (forecast.Headroom), its queued builds counted."""
        return self.call_async("headroom")

    def observe_decoder_cost(self, frame_s: float, call_s: float, calls_per_s: float) -> None:
        self._send_quietly(("decoder_cost", frame_s, call_s, calls_per_s))

    def start_counts(self) -> tuple[int, int, int]:
        """As GenerationLoop.start_counts, from the requests this front submitted: the front
        keeps their playback clocks, and sees their admission (the engine's `Admitted`)."""
        live = list(self._requests.values())  # one C-level copy: the reader thread pops from it
        # In submission order (a dict keeps insertion order).
        backlog = StartPlanner.backlog(list(self._queued.values()), time.monotonic())
        return sum(1 for req in live if req.first_audio_at is None), len(live), backlog

    # -- calls --------------------------------------------------------------------------------
    def call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """Run `name` in the engine process and return its value (blocking: off the event loop)."""
        future = self.call_async(name, *args)
        self._send_quietly(None)  # now, with any deferred before it: this thread waits for it
        return future.result(timeout)

    def call_async(self, name: str, *args: Any) -> concurrent.futures.Future:
        """Run `name` in the engine process; its value (or error) arrives on the future."""
        call_id = next(self._ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = future
        future.add_done_callback(lambda _: self._calls.pop(call_id, None))
        try:
            self._check_alive()
        except Unavailable as exc:
            future.set_exception(exc)
            return future
        self._defer(("call", call_id, name, args))
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
    def _check_alive(self) -> None:
        if self._lost is not None or self._cmd is None:
            raise Unavailable(f"the talker's engine is not running: {self._lost or 'not started'}")

    def _send(self, message: tuple | None) -> None:
        """Send `message` (None: only the deferred ones), after the deferred messages before it."""
        self._check_alive()
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
        grants, playback clocks, submissions, cancels and calls (prompt builds, the published
        room) come for hundreds of streams a second, and each message costs a pickle and a pipe
        write on the event loop and the engine process's threads a receive and an unpickle under
        their GIL. Off an event loop it goes at once; any message sent directly goes after the
        deferred ones."""
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
                self._answered(*message[1:])
            elif kind == "replies":
                for reply in message[1]:
                    self._answered(*reply)
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

    def _answered(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._calls.get(call_id)
        if future is not None and not future.done():
            (future.set_result if ok else future.set_exception)(value)
        elif ok:  # its caller went away (cancelled): a prompt built for it is freed
            self._drop_unclaimed(value)

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
            if isinstance(ev, Admitted | Finished | Failed):
                self._queued.pop(rid, None)
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
        self._queued = {}
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


__all__ = ["EngineClient", "RemoteBundle", "RemoteOpenText", "engine_process_on"]
