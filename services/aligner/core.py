"""The aligner's domain core: checks a request, featurises it, batches forward passes.

Requests are featurised as they arrive (resampling, log-mel, word splitting, tokenising) on one
thread of their own (the fast tokenizer and nagisa are not safe to call from several threads at
once, and the GIL would serialise most of that work anyway), then wait in one queue; a single
loop takes up to `max_batch` of them into one forward pass on its own thread, so the device runs
one batch at a time and requests that arrive while it works share the next pass. A pass also waits
until its oldest request has waited `gather_s` (or a full batch is queued): segments end a few
dozen a second, each pass takes milliseconds, so without the wait nearly every pass carried one or
two requests, and a pass of one costs about 5x the GPU time per audio-second of a pass of eight
(2.0 against 0.43 ms on an H200). The wait delays only the timestamps, which follow audio that
plays for seconds. A request
cancelled while queued never reaches the device. The pass is `BucketedAligner.run`: the batch
padded to fixed (batch, length) buckets, a CUDA graph per bucket on a GPU, eager on the CPU.

The aligner shares its GPU with the talker and code2wav, whose streams play in real time. Segments
end in bursts (a closed loop's round, a crowd of listeners starting together): 384 ten-second
segments are about a second of an H100's time in back-to-back passes, during which the other
engines' steps stretch and young streams, with a few hundred milliseconds buffered, ran dry
(benchmarks/HISTORY.md, 2026-12-06). `gpu_share` bounds the passes' duty cycle: after a pass that
took t seconds the next one starts no sooner than t * (1 / gpu_share - 1) later (the requests
arriving meanwhile join it), so a burst is aligned over a longer time instead of taking the
whole device at once. Only the timestamps wait, and they follow audio that plays for seconds. The
share gives way once the oldest queued request has waited `share_max_wait_s`: when the passes
need more than the share for long (more streams than the share can align), timestamps later and
later would be worse than a busier GPU, so the passes then run back to back until the queue is
young again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from qtts.model.aligner import AlignInput, UnsupportedLanguage, WordTiming
from qtts.model.aligner.batched import BucketedAligner
from qtts.request.errors import InvalidArgument
from qtts.serving.metrics import AlignerMetrics

log = logging.getLogger(__name__)

MIN_SAMPLE_RATE_HZ, MAX_SAMPLE_RATE_HZ = 8000, 192000


def _has_kana(text: str) -> bool:
    return any(0x3040 <= ord(ch) <= 0x30FF for ch in text)


def splitting_language(language: str, text: str) -> str:
    """The language whose word splitting applies. "auto" (or empty) is Japanese when the text has
    kana, else the whitespace-and-ideograph splitting every other language uses."""
    lang = (language or "auto").strip().lower()
    if lang == "auto":
        return "japanese" if _has_kana(text) else "english"
    return lang


@dataclass(frozen=True)
class AlignJob:
    text: str
    language: str
    pcm: np.ndarray  # mono: float32 in [-1, 1], or int16 (scaled when featurised)
    sample_rate_hz: int
    offset_s: float = 0.0


@dataclass(frozen=True)
class AlignOutcome:
    words: list[WordTiming]
    forward_ns: int
    batch_size: int


class AlignerCore:
    """Checks, featurises and batches `AlignJob`s over one `BucketedAligner`."""

    def __init__(
        self,
        runner: BucketedAligner,
        metrics: AlignerMetrics,
        *,
        max_batch: int = 32,
        gather_s: float = 0.0,
        max_audio_s: float = 300.0,
        max_text_chars: int = 4096,
        gpu_share: float = 1.0,
        share_max_wait_s: float = 3.0,
    ):
        if not 0 < gpu_share <= 1 or share_max_wait_s < 0:
            raise ValueError(
                f"gpu_share must be in (0, 1] and share_max_wait_s >= 0, got {gpu_share}, {share_max_wait_s}"
            )
        self.runner = runner
        self.aligner = runner.aligner
        self.metrics = metrics
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.max_audio_s = max_audio_s
        self.max_text_chars = max_text_chars
        self.gpu_share = gpu_share
        self.share_max_wait_s = share_max_wait_s
        self._next_pass_at = 0.0  # loop time before which no pass starts (the duty cycle's rest)
        # (prepared request, its answer, the loop time it was queued)
        self._queue: list[tuple[AlignInput, asyncio.Future, float]] = []
        self._wake = asyncio.Event()
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aligner-forward")
        self._featurise = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aligner-prepare")
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._batches())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for _, fut, _ in self._queue:
            if not fut.done():
                fut.cancel()
        self._queue.clear()
        self._device.shutdown(wait=False, cancel_futures=True)
        self._featurise.shutdown(wait=False, cancel_futures=True)

    def check(self, job: AlignJob) -> None:
        """Raise `InvalidArgument` naming what is wrong with the request."""
        if not MIN_SAMPLE_RATE_HZ <= job.sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
            raise InvalidArgument(
                f"sample_rate_hz must be in {MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ}, got {job.sample_rate_hz}"
            )
        if job.pcm.size == 0:
            raise InvalidArgument("the audio is empty: pcm_s16le and pcm_f32 hold no sample")
        seconds = job.pcm.size / job.sample_rate_hz
        if seconds > self.max_audio_s:
            raise InvalidArgument(
                f"the audio is {seconds:.1f} s long; at most {self.max_audio_s:g} s can be aligned"
            )
        if job.pcm.dtype.kind == "f" and not np.isfinite(job.pcm).all():
            raise InvalidArgument("pcm_f32 holds NaN or infinite samples")
        if not job.text.strip():
            raise InvalidArgument("text is empty")
        if len(job.text) > self.max_text_chars:
            raise InvalidArgument(
                f"text is {len(job.text)} characters; at most {self.max_text_chars} are aligned"
            )
        if job.offset_s < 0 or not np.isfinite(job.offset_s):
            raise InvalidArgument(f"offset_s must be a finite number >= 0, got {job.offset_s}")

    def _prepare(self, job: AlignJob) -> AlignInput:
        pcm = job.pcm
        if pcm.dtype.kind == "i":
            pcm = pcm.astype(np.float32) / 32768.0
        try:
            return self.aligner.prepare(
                pcm, job.sample_rate_hz, job.text, splitting_language(job.language, job.text)
            )
        except (UnsupportedLanguage, ValueError) as e:
            raise InvalidArgument(str(e)) from None

    async def align(self, job: AlignJob) -> AlignOutcome:
        """Word timings of `job` (times shifted by its offset)."""
        self.check(job)
        prepared = await asyncio.get_running_loop().run_in_executor(self._featurise, self._prepare, job)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._queue.append((prepared, fut, loop.time()))
        self.metrics.queued.set(len(self._queue))
        self._wake.set()
        words, forward_ns, batch_size = await fut
        self.metrics.audio_seconds_total.inc(job.pcm.size / job.sample_rate_hz)
        if job.offset_s:
            words = [
                WordTiming(w.word, round(w.start_s + job.offset_s, 3), round(w.end_s + job.offset_s, 3))
                for w in words
            ]
        return AlignOutcome(words, forward_ns, batch_size)

    async def _batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._rest()
                await self._gather()
                taken = [(x, f) for x, f, _ in self._queue[: self.max_batch] if not f.done()]
                del self._queue[: self.max_batch]
                self.metrics.queued.set(len(self._queue))
                if not taken:
                    continue
                start = time.perf_counter_ns()
                try:
                    results = await loop.run_in_executor(self._device, self.runner.run, [x for x, _ in taken])
                except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
                    log.exception("aligner forward pass failed")
                    for _, f in taken:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                elapsed = time.perf_counter_ns() - start
                self._next_pass_at = loop.time() + elapsed / 1e9 * (1.0 / self.gpu_share - 1.0)
                self.metrics.batch_size.observe(len(taken))
                self.metrics.forward_seconds.observe(elapsed / 1e9)
                for (_, f), words in zip(taken, results, strict=True):
                    if not f.done():
                        f.set_result((words, elapsed, len(taken)))

    async def _rest(self) -> None:
        """Wait out the rest that keeps the passes within `gpu_share` of the time, unless (or
        until) the oldest queued request has waited `share_max_wait_s`."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        left = self._next_pass_at - now
        if left > 0 and self._queue:
            left = min(left, self._queue[0][2] + self.share_max_wait_s - now)
        if left > 0:
            self.metrics.rest_seconds_total.inc(left)
            await asyncio.sleep(left)

    async def _gather(self) -> None:
        """Wait until the oldest queued request has waited `gather_s` or a full batch is queued."""
        loop = asyncio.get_running_loop()
        while 0 < len(self._queue) < self.max_batch:
            left = self._queue[0][2] + self.gather_s - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            try:  # each new request wakes it; asyncio.timeout: wait_for can swallow a cancel
                async with asyncio.timeout(left):
                    await self._wake.wait()
            except TimeoutError:
                return

    async def warm_up(self, graph_seconds: list[float] | None = None) -> int:
        """One alignment of a short clip (lazy kernels load), then, on a GPU, the CUDA graphs of
        clips `graph_seconds` long at every batch size: before health says SERVING. Returns the
        graphs captured."""
        t = np.arange(24000, dtype=np.float32) / 24000
        await self.align(
            AlignJob("warm up", "english", (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 24000)
        )
        if not graph_seconds:
            return len(self.runner.captured())
        return await asyncio.get_running_loop().run_in_executor(
            self._device, self.runner.warm_up, graph_seconds, self.max_batch
        )
