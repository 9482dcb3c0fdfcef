"""The talker's prompt queue: one thread builds every prompt in arrival order, under the
first-audio budget.

A pool of threads (asyncio.to_thread's) ran a burst's prompts side by side: dozens of threads
taking the GIL back after each of their many small torch calls, and the engine thread waiting
behind them for its own. The queue is the first one a request waits in, so the budget holds here
too: a request whose prompt could not start being built within it is refused at once
(`check`), and one that waited past it is not built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from qtts.request.errors import InvalidArgument, ResourceExhausted
from qtts.serving.metrics import TalkerMetrics


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
    """The prompt thread, its CUDA stream, and the waiting count and build time the at-once
    refusal predicts with (`waiting` also counts prompts built in an engine process)."""

    def __init__(self, bundle: Any, metrics: TalkerMetrics, budget_s: float = 0.0):
        self.bundle = bundle
        self.budget_s = budget_s
        self.waiting = 0
        self.build_s = 0.0  # moving average of one prompt's build time
        self._metrics = metrics
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="talker-prompt")
        self._stream: Any = None  # None: not looked at yet; False: no GPU

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

    def build(self, make: Callable[[], Any], queued_at: float | None = None) -> tuple[Any, np.ndarray | None]:
        """In the prompt thread: the prompt `make()` builds, and its ICL reference frames as
        int16 host rows for code2wav (or None); refused when it waited past the budget.

        On a GPU the prompt's kernels run on a CUDA stream of their own, and the thread waits for
        that stream only: on the engine's stream every host copy of a prompt waited behind the
        frame step queued before it."""
        started = time.perf_counter()
        if queued_at is not None:
            self._metrics.observe_stage("prompt_queue", started - queued_at)
            if self.budget_s > 0 and started - queued_at > self.budget_s:
                raise ResourceExhausted(
                    f"the talker is at capacity: the request waited {started - queued_at:.1f} s for its "
                    f"prompt, past the {self.budget_s:g} s first-audio budget; retry later",
                    max(1, round(self.waiting * self.build_s)),
                )
        prompt = self._on_stream(make)
        built_s = time.perf_counter() - started
        self._metrics.observe_stage("build_prompt", built_s)
        self.observe_build(built_s)
        return prompt, reference_rows(prompt)

    def push(self, open_text: Any, piece: str, final: bool) -> tuple[Any, np.ndarray | None] | None:
        """In the prompt thread: hand a piece to `open_text`; the prompt and its reference frames
        once it is built, else None."""
        started = time.perf_counter()
        try:
            prompt = self._on_stream(lambda: open_text.push(piece, final))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        if prompt is None:
            return None
        built_s = time.perf_counter() - started
        self._metrics.observe_stage("build_prompt", built_s)
        self.observe_build(built_s)
        return prompt, reference_rows(prompt)

    def _on_stream(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the prompt thread's CUDA stream, waiting for that stream (off the GPU: as is)."""
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
