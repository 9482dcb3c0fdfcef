"""The engine process's prompt builds: queued as the front asks, built on the prompt thread on a
CUDA stream of their own, and answered once the GPU has run them (`--prompt-builds`: a batch per
wait, or pipelined), with the first-audio budget checked as each build starts."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from qtts.request.errors import ResourceExhausted

from .engine_wire import RemotePrompt, spec_from_wire
from .prompt_queue import MAX_BUILD_BATCH  # one cap for both prompt queues


class PromptBuilds:
    """The build queue of the engine process; every method but `add` runs on its prompt thread.

    `reply(call_id, ok, value)` answers the front; `store(prompt)` keeps a built prompt and returns
    the handle the front gets. `build`, `build_many`, `metrics` and `stream` (the prompt stream,
    None off the GPU) are set once the model is loaded; `reply_many` (one message for many
    answers) where the front reads it."""

    def __init__(
        self, mode: str, reply: Callable[[int, bool, Any], None], store: Callable[[Any], RemotePrompt]
    ):
        self.mode = mode
        self._reply_one = reply
        self._store = store
        self.build: Callable[[Any], Any] | None = None
        self.build_many: Callable[[list], list] | None = None  # prompts or errors, in order
        self.reply_many: Callable[[list[tuple[int, bool, Any]]], None] | None = None  # one message
        self.metrics: Any = None
        self.stream: Any = None
        self._waiting: collections.deque[tuple[int, Any, float, float]] = collections.deque()
        self.queued = 0  # builds waiting for the prompt thread
        # Builds asked for (counted by the thread that reads the front's commands) and answered
        # (by the prompt thread): one writer each, so `pending` needs no lock.
        self._asked = 0
        self._answered = 0
        self.build_s = 0.0  # moving average of one build
        self._last_answer_at = 0.0  # when the last pipelined build was answered
        # Pipelined builds whose kernels were queued, not yet answered: (call, began, prompt, event).
        self._inflight: collections.deque[tuple[int, float, Any, Any]] = collections.deque()

    def add(self, call_id: int, spec: Any, queued_at: float, budget_s: float) -> None:
        """Queue a build (on the thread that reads the front's commands); `build_queued` runs it."""
        self.queued += 1
        self._asked += 1
        self._waiting.append((call_id, spec, queued_at, budget_s))

    def on_stream(self, fn: Callable, *args: Any, wait: bool = True) -> Any:
        """`fn(*args)` on the prompt thread's CUDA stream, waited for unless `wait` is False (the
        engine reads the embeddings from its own stream, so someone must wait before it does)."""
        if self.stream is None:
            return fn(*args)
        import torch

        with torch.cuda.stream(self.stream):
            out = fn(*args)
        if wait:
            self.stream.synchronize()
        return out

    def build_queued(self) -> None:
        """Build the queued prompts and answer them, as `--prompt-builds` says."""
        if self.mode == "pipelined":
            self._build_pipelined()
        else:
            self._build_batch()

    def _build_batch(self) -> None:
        """Build the queued prompts (at most `MAX_BUILD_BATCH`) together (`build_many`: a fixed
        dozen device calls, each a GIL release, whatever their number), then wait for the prompt
        stream once and answer them in one message: one wait for the GPU per batch, not per
        prompt, as a burst arrives."""
        batch = []
        while self._waiting and len(batch) < MAX_BUILD_BATCH:
            batch.append(self._waiting.popleft())
        if not batch:
            return  # built by an earlier call
        started = time.perf_counter()
        replies: list[tuple[int, bool, Any]] = []
        todo: list[tuple[int, Any]] = []
        for call_id, spec, queued_at, budget_s in batch:
            try:
                todo.append((call_id, self._admit_build(spec, queued_at, budget_s, started)))
            except Exception as exc:  # noqa: BLE001 - this caller gets the error, the rest go on
                replies.append((call_id, False, exc))
        try:
            built = self.on_stream(self.build_many, [spec for _, spec in todo], wait=False) if todo else []
            if self.stream is not None and todo:
                self.stream.synchronize()  # the engine reads the embeddings from its own stream
        except Exception as exc:  # noqa: BLE001 - a device error fails every prompt of the batch
            self._reply_many(replies + [(call_id, False, exc) for call_id, _ in todo])
            return
        done = time.perf_counter()
        per_build = (done - started) / len(batch)  # the drain rate the refusals predict with
        self.build_s = per_build if self.build_s == 0 else self.build_s + 0.1 * (per_build - self.build_s)
        for (call_id, _), prompt in zip(todo, built, strict=True):
            if isinstance(prompt, Exception):
                replies.append((call_id, False, prompt))
                continue
            self.metrics.observe_stage("build_prompt", done - started)
            remote = self._store(prompt)
            remote.build_s = self.build_s
            replies.append((call_id, True, remote))
        self._reply_many(replies)

    @property
    def pending(self) -> int:
        """Builds asked for and not yet answered (waiting, being built, or built and not yet
        stored): requests the engine's admission counts ahead of a new one."""
        return self._asked - self._answered

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        self._answered += 1
        self._reply_one(call_id, ok, value)

    def _reply_many(self, replies: list[tuple[int, bool, Any]]) -> None:
        self._answered += len(replies)
        if self.reply_many is not None:
            self.reply_many(replies)
        else:
            for reply in replies:
                self._reply_one(*reply)

    def _build_pipelined(self) -> None:
        """Build up to `MAX_BUILD_BATCH` queued prompts, each followed by an event on the prompt
        stream, answering each prompt as soon as its event has passed, oldest first; with nothing
        left to build, wait for the GPU and answer the rest. So the thread waits for the GPU only
        when it has nothing to build: the build rate is the host's, not one batch per wait (which
        a busy GPU made one batch per engine step). Builds still in flight when this call stops
        at the cap are answered by the next call (one is queued for every build), and the calls
        queued beside them (voice prompts, text) get their turn in between."""
        started = 0
        while self._waiting and started < MAX_BUILD_BATCH:
            call_id, spec, queued_at, budget_s = self._waiting.popleft()
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
        while self._inflight and not self._waiting:
            self._answer_passed(wait=True)

    def _record_event(self) -> Any:
        """An event recorded on the prompt stream now (None without one: the build is done)."""
        if self.stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
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
                self.build_s = (
                    per_build if self.build_s == 0 else self.build_s + 0.1 * (per_build - self.build_s)
                )
                self.metrics.observe_stage("build_prompt", done - began)
                remote = self._store(prompt)
                remote.build_s = self.build_s
                self._reply(call_id, True, remote)
        except Exception as exc:  # noqa: BLE001 - a device error fails every prompt in flight
            while inflight:
                self._reply(inflight.popleft()[0], False, exc)

    def _admit_build(self, spec: Any, queued_at: float, budget_s: float, started: float) -> Any:
        """The spec of a build that starts now (from the wire); refused when it waited past the
        first-audio budget to start."""
        self.queued -= 1
        self.metrics.observe_stage("prompt_queue", started - queued_at)
        if budget_s > 0 and started - queued_at > budget_s:
            raise ResourceExhausted(
                f"the talker is at capacity: the request waited {started - queued_at:.1f} s for its "
                f"prompt, past the {budget_s:g} s first-audio budget; retry later",
                max(1, round(self.queued * self.build_s)),
            )
        return spec_from_wire(spec)

    def _start_build(self, spec: Any, queued_at: float, budget_s: float, started: float) -> Any:
        """The prompt of `spec` with its kernels queued on the prompt stream (not waited for);
        refused when it waited past the first-audio budget to start."""
        return self.on_stream(self.build, self._admit_build(spec, queued_at, budget_s, started), wait=False)
