"""Voice prompts computed in batches on one thread: the clips that arrive while a batch is being
computed wait together and go as the next batch, so a burst of N new voices costs a few encoder
calls, not N calls one after another.

The thread only waits (on the voice worker's pipe, or on the encoders in this process when there
is no worker), so it costs the front's event loop nothing. Each clip's queue wait and the time
of the computation that produced it are the stages `voice_prompt_queue` and
`compute_voice_prompt`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qtts.model.voice_encoders import VoiceClip
from qtts.request.errors import Unavailable

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 16


@dataclass
class _Job:
    clip: VoiceClip
    future: concurrent.futures.Future
    queued_at: float = field(default_factory=time.perf_counter)


def one_by_one(compute_one: Callable[[Any, str | None, bool], Any]) -> Callable[[list[VoiceClip]], list[Any]]:
    """A batch computer over a per-clip `compute_voice_prompt(pcm, ref_text, x_vector_only)`."""

    def compute_many(clips: list[VoiceClip]) -> list[Any]:
        out: list[Any] = []
        for clip in clips:
            try:
                out.append(compute_one(clip.pcm, clip.ref_text, clip.x_vector_only))
            except Exception as exc:  # noqa: BLE001 - this clip's error alone
                out.append(exc)
        return out

    return compute_many


class VoicePromptBatcher:
    """Computes voice prompts with `compute_many` (clips -> each clip's prompt or error), on one
    thread, taking every clip waiting (up to `max_batch`) into each call."""

    def __init__(
        self,
        compute_many: Callable[[list[VoiceClip]], list[Any]],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        metrics: Any = None,
        name: str = "voice-prompt",
    ):
        self._compute_many = compute_many
        self._max_batch = max(1, max_batch)
        self._metrics = metrics
        self._name = name
        self._pending: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.batches = 0  # calls of compute_many
        self.largest_batch = 0

    async def compute(self, clip: VoiceClip) -> Any:
        """The clip's `VoicePrompt`; raises the clip's error."""
        return await asyncio.wrap_future(self.submit(clip))

    def submit(self, clip: VoiceClip) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise Unavailable("the talker is stopping: no voice prompt is computed")
            self._pending.append(_Job(clip, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def _take(self) -> list[_Job] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            batch = []
            while self._pending and len(batch) < self._max_batch:
                batch.append(self._pending.popleft())
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            started = time.perf_counter()
            live = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if not live:
                continue
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(live))
            try:
                results = self._compute_many([job.clip for job in live])
            except Exception as exc:  # noqa: BLE001 - the computer's own failure: every clip's
                log.exception("voice prompt computation failed")
                results = [
                    Unavailable(f"the voice prompt could not be computed: {type(exc).__name__}")
                ] * len(live)
            took = time.perf_counter() - started
            for job, result in zip(live, results, strict=True):
                self._observe(started - job.queued_at, took)
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _observe(self, waited_s: float, computed_s: float) -> None:
        if self._metrics is not None:
            self._metrics.observe_stage("voice_prompt_queue", waited_s)
            self._metrics.observe_stage("compute_voice_prompt", computed_s)

    def close(self) -> None:
        """Fail what waits and let the thread end (a batch in flight ends with its computer)."""
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        for job in pending:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(Unavailable("the talker is stopping: no voice prompt is computed"))
