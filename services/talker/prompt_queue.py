"""The talker's prompt queue: one thread builds every prompt in arrival order, under the
first-audio budget, the prompts queued when it comes to them together.

A pool of threads (asyncio.to_thread's) ran a burst's prompts side by side: dozens of threads
taking the GIL back after each of their many small torch calls, and the engine thread waiting
behind them for its own. The queue is the first one a request waits in, so the budget holds here
too: a request whose prompt could not start being built within it is refused at once
(`check`), and one that waited past it is not built.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from qtts.request.errors import InvalidArgument, ResourceExhausted
from qtts.serving.metrics import TalkerMetrics
from qtts.streams.chunk_plan import StartPlanner

# Prompts built together before one wait for the prompt stream: enough for a burst, few enough
# that the first of them is not held long behind the last (a batch's host work is about 0.1-0.3 ms
# a prompt: tokenising and laying out; its device calls are a fixed dozen). The engine process's
# queue (engine_prompts.py) builds as many at a time.
MAX_BUILD_BATCH = 16


def reference_rows(prompt: Any) -> np.ndarray | None:
    """A prompt's ICL reference frames as int16 host rows for code2wav (None without)."""
    rows = getattr(prompt, "ref_codes_host", False)
    if rows is not False:  # built in the engine process (engine_process.RemotePrompt)
        return rows
    ref = getattr(prompt, "ref_codes", None)
    if ref is None:
        return None
    if ref.device.type != "cpu" or ref.requires_grad:
        ref = ref.detach().to("cpu")
    return ref.numpy().astype(np.int16)  # no device call for host codes: each releases the GIL


class PromptQueue:
    """The prompt thread, its CUDA stream, and the requests waiting for their prompts with the
    build time the at-once refusal predicts with (`waiting` also counts prompts built in an engine
    process)."""

    def __init__(self, bundle: Any, metrics: TalkerMetrics, budget_s: float = 0.0):
        self.bundle = bundle
        self.budget_s = budget_s
        self.build_s = 0.0  # moving average of one prompt's build time
        # When each request waiting for its prompt was queued, in queue order (`waiting_for`).
        self._waiting: dict[int, float] = {}
        self._tokens = itertools.count()
        self._metrics = metrics
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="talker-prompt")
        self._stream: Any = None  # None: not looked at yet; False: no GPU
        # Builds not yet taken by the prompt thread: (spec, queued_at, answer).
        self._queued: collections.deque[tuple[Any, float, concurrent.futures.Future]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for their prompts (queued or being built)."""
        return len(self._waiting)

    @contextlib.contextmanager
    def waiting_for(self, queued_at: float) -> Iterator[None]:
        """Count a request as waiting for its prompt, queued at `queued_at`, while in the block."""
        token = next(self._tokens)
        self._waiting[token] = queued_at
        try:
            yield
        finally:
            del self._waiting[token]

    def start_counts(self, now: float) -> tuple[int, int]:
        """(requests waiting for their prompts, those queued `StartPlanner.BACKLOG_AGE_S` or
        longer before `now`): streams about to start, beside the engine's own counts. In a burst
        the prompts of dozens of requests are built together, and the first stream made from a
        batch would otherwise see none of the others starting."""
        # In queue order (a dict keeps insertion order).
        return len(self._waiting), StartPlanner.backlog(list(self._waiting.values()), now)

    def check(self) -> None:
        """Refuse at once a request whose prompt would start being built past the budget."""
        wait = self.waiting * self.build_s
        if self.budget_s > 0 and wait > self.budget_s:
            raise ResourceExhausted(
                f"the talker is at capacity: {self.waiting} prompts wait to be built, about "
                f"{wait:.1f} s, over the {self.budget_s:g} s first-audio budget; retry later",
                max(1, round(wait)),
            )

    def observe_build(self, built_s: float) -> None:
        """Keep the moving average of one prompt's build the at-once refusal predicts with."""
        self.build_s = built_s if self.build_s == 0 else self.build_s + 0.1 * (built_s - self.build_s)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the prompt thread, after everything queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def build(self, spec: Any, queued_at: float) -> tuple[Any, np.ndarray | None]:
        """The prompt of `spec` and its ICL reference frames as int16 host rows for code2wav (or
        None), built in the prompt thread with the prompts queued beside it (`build_queued`);
        refused when it waited past the budget. A caller that goes away before the thread takes
        its spec costs no build."""
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._queued.append((spec, queued_at, answer))
        self._thread.submit(self.build_queued)
        return await asyncio.wrap_future(answer)

    def build_queued(self) -> None:
        """In the prompt thread: build the queued prompts (at most `MAX_BUILD_BATCH`) together
        (`build_many`: one tokenizer call and a fixed dozen device calls, whatever their number)
        and wait for the prompt stream once. Each caller gets its own prompt or error: one that
        waited past the budget is refused, a spec the builder refuses fails alone, a device error
        fails the batch. (Each `build` queues a call; one that finds nothing queued returns.)"""
        batch = []
        while self._queued and len(batch) < MAX_BUILD_BATCH:
            spec, queued_at, answer = self._queued.popleft()
            if answer.set_running_or_notify_cancel():  # else its caller went away
                batch.append((spec, queued_at, answer))
        try:
            self._build_batch(batch)
        except Exception as exc:  # noqa: BLE001 - a device error fails every prompt of the batch
            for _, _, answer in batch:
                if not answer.done():  # not refused before the build
                    answer.set_exception(exc)

    def _build_batch(self, batch: list[tuple[Any, float, concurrent.futures.Future]]) -> None:
        """Answer each of `batch`: refused past the budget, or built with the rest."""
        if not batch:
            return
        started = time.perf_counter()
        todo = []
        for spec, queued_at, answer in batch:
            try:
                self._admit(queued_at, started)
            except ResourceExhausted as exc:
                answer.set_exception(exc)
                continue
            todo.append((spec, answer))
        if not todo:
            return
        built = self._on_stream(lambda: self._build_many([spec for spec, _ in todo]))
        batch_s = time.perf_counter() - started
        self.observe_build(batch_s / len(batch))  # the drain rate the refusals predict with
        for (_, answer), prompt in zip(todo, built, strict=True):
            if isinstance(prompt, Exception):  # this spec's error, the rest go on
                answer.set_exception(_invalid(prompt) if isinstance(prompt, ValueError) else prompt)
                continue
            self._metrics.observe_stage("build_prompt", batch_s)  # as the engine process counts
            try:
                answer.set_result((prompt, reference_rows(prompt)))
            except Exception as exc:  # noqa: BLE001 - this caller's error, the rest go on
                answer.set_exception(exc)

    def _admit(self, queued_at: float, started: float) -> None:
        """Count a build's wait; refuse it when it waited past the budget to start."""
        self._metrics.observe_stage("prompt_queue", started - queued_at)
        if self.budget_s > 0 and started - queued_at > self.budget_s:
            raise ResourceExhausted(
                f"the talker is at capacity: the request waited {started - queued_at:.1f} s for its "
                f"prompt, past the {self.budget_s:g} s first-audio budget; retry later",
                max(1, round(self.waiting * self.build_s)),
            )

    def _build_many(self, specs: list[Any]) -> list[Any]:
        """The prompt of each spec, or the error that refuses it (a bundle without a
        `prompt_builder`, as the tests' fakes: one `build_prompt` each)."""
        builder = getattr(self.bundle, "prompt_builder", None)
        if builder is not None:
            return builder.build_many(specs)
        built: list[Any] = []
        for spec in specs:
            try:
                built.append(self.bundle.build_prompt(spec))
            except Exception as exc:  # noqa: BLE001 - this spec's error, the rest go on
                built.append(exc)
        return built

    def push(self, open_text: Any, piece: str, final: bool) -> tuple[Any, np.ndarray | None] | None:
        """In the prompt thread: hand a piece to `open_text`; the prompt and its reference frames
        once it is built, else None."""
        started = time.perf_counter()
        try:
            prompt = self._on_stream(lambda: open_text.push(piece, final))
        except ValueError as exc:
            raise _invalid(exc) from exc
        if prompt is None:
            return None
        built_s = time.perf_counter() - started
        self._metrics.observe_stage("build_prompt", built_s)
        self.observe_build(built_s)
        return prompt, reference_rows(prompt)

    def _on_stream(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the prompt thread's CUDA stream, waiting for that stream (off the GPU: as is).

        On a GPU the prompts' kernels run on a CUDA stream of their own, and the thread waits for
        that stream only: on the engine's stream every host copy of a prompt waited behind the
        frame step queued before it."""
        stream = self.cuda_stream()
        if stream is None:
            return fn()
        import torch

        with torch.cuda.stream(stream):
            value = fn()
        stream.synchronize()  # the engine reads the embeddings from its own stream
        return value

    def cuda_stream(self) -> Any:
        """The prompt thread's CUDA stream (made on first use), or None off the GPU."""
        if self._stream is None:
            device = getattr(self.bundle, "device", None)
            if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
                self._stream = False
            else:
                import torch

                self._stream = torch.cuda.Stream(device=device, priority=-1)  # ahead of frame steps
        return self._stream or None


def _invalid(exc: ValueError) -> InvalidArgument:
    """A spec or text the builder refuses, as the caller's error (its cause kept)."""
    err = InvalidArgument(str(exc))
    err.__cause__ = exc
    return err
