"""New streams' decoder states, made in batches on the decode worker, one batch at a time.

A state with an ICL reference prefix the engine has not cached costs a prefix decode (eager
frame-rate windows and planned tail steps). Handed to the single worker one by one, a burst of
opens queued many of them ahead of the running streams' next decode call, and listeners already
playing heard gaps. `StateStarter` queues the opens instead: a drain task hands the worker one
job at a time (one `start_many` call, where the engine decodes equal misses together): at most
`START_BATCH` prefix decodes and `START_MAX` states in all (a start without a prefix, or with one
whose state the engine has cached, is a copy), and submits the next job only when that one is done. The decode loop keeps at most one
decode call in flight too, so in the worker's FIFO a decode call waits behind at most one batch of
starts, and a batch of starts behind at most one decode call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from qtts.serving.metrics import Code2WavMetrics
from services.code2wav.stream import DecodeStream

log = logging.getLogger(__name__)

# Prefix decodes per worker job at most: the longest a decode call can wait behind starts. `start`
# with an uncached 75-frame prefix took 15 ms (TF32) / 21 ms (bf16) on an H200, most of it the
# eager frame-rate windows, which only prefixes of equal length share; so a job of 8 misses of
# distinct lengths may hold a decode call back for tens of milliseconds (estimate).
START_BATCH = 8
# States per worker job at most, cheap ones included (no prefix, or a prefix whose state the engine
# has cached: a grouped copy). With 8 of any kind a turn, a closed loop of 768 streams on the
# stand-in decoder (benchmarks/code2wav_host.py) spent 0.41 s on average in `open_stream` and
# 64 took 0.08 s: each turn of the worker also waits for a decode call.
START_MAX = 64


def make_states(
    decoder: Any, device: torch.device, metrics: Code2WavMetrics, prefixes: list[np.ndarray | None]
) -> list[Any]:
    """New decoder states after `prefixes` (worker thread): one result per prefix, its state or the
    exception that stream met. Engines with `start_many` make them in one pass, others one `start`
    each. Counts the slots engine's prefix-state cache hits and misses."""
    with torch.inference_mode():
        codes = [None if p is None else torch.from_numpy(p.astype(np.int64)).to(device) for p in prefixes]
        hits, misses = getattr(decoder, "prefix_hits", None), getattr(decoder, "prefix_misses", None)
        start_many = getattr(decoder, "start_many", None)
        if start_many is not None:
            results = list(start_many(codes))
        else:
            results = []
            for c in codes:
                try:
                    results.append(decoder.start(c))
                except Exception as exc:  # noqa: BLE001 - this stream fails, the others go on
                    results.append(exc)
        if hits is not None:
            metrics.prefix_state_hits_total.inc(decoder.prefix_hits - hits)
        if misses is not None:
            metrics.prefix_state_misses_total.inc(decoder.prefix_misses - misses)
        return results


@dataclass
class _Pending:
    stream: DecodeStream
    prefix: np.ndarray | None
    began: float = field(default_factory=time.perf_counter)
    costly: bool | None = None  # decodes its prefix (worked out once, when first looked at)


class StateStarter:
    """The queue of states to make and the task that drains it into the worker (module docstring).

    `on_made(stream, began, fut)` runs on the event loop for every stream taken, once its state is
    made (`fut` holds it), failed (`fut` holds the error) or cancelled at shutdown. Streams closed
    before their turn are dropped without a state."""

    def __init__(
        self,
        decoder: Any,
        device: torch.device,
        metrics: Code2WavMetrics,
        executor: Executor,
        on_made: Callable[[DecodeStream, float, asyncio.Future], None],
        batch: int = START_BATCH,
        most: int = START_MAX,
    ):
        if batch < 1 or most < batch:
            raise ValueError(f"need 1 <= batch <= most, got {batch} and {most}")
        self._job = functools.partial(make_states, decoder, device, metrics)
        self._executor = executor
        self._on_made = on_made
        self.batch = batch
        self.most = most
        # Whether a prefix's state is cached (a cheap start); engines without the cache: never.
        self._cached: Callable[[np.ndarray], bool] = getattr(decoder, "prefix_cached", lambda _: False)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, stream: DecodeStream, prefix: np.ndarray | None) -> None:
        """Queue `stream`'s state (event loop); the drain task starts if it is not running."""
        self._queue.append(_Pending(stream, prefix))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain(), name="code2wav-state-starts")

    async def close(self) -> None:
        """Stop draining (shutdown): queued streams get no state; a batch in the worker still
        reports to `on_made` when it ends."""
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while batch := self._take():
            fut = loop.run_in_executor(self._executor, self._job, [p.prefix for p in batch])
            # Registered before the await's own callback: the states are in place (and their
            # streams notified) before the next batch is submitted, and even if this task is
            # cancelled meanwhile.
            fut.add_done_callback(functools.partial(self._made, batch))
            with contextlib.suppress(Exception):  # reported per stream by `_made`
                await asyncio.shield(fut)

    def _take(self) -> list[_Pending]:
        """The next job, in arrival order: at most `most` states, of which at most `batch` decode a
        prefix (the rest have none, or one the engine has cached)."""
        batch: list[_Pending] = []
        decodes = 0
        while self._queue and len(batch) < self.most:
            pending = self._queue[0]
            if pending.stream.closed:
                self._queue.popleft()
                continue
            if pending.costly is None:
                pending.costly = pending.prefix is not None and not self._cached(pending.prefix)
            costly = pending.costly
            if costly and decodes >= self.batch:
                break
            self._queue.popleft()
            batch.append(pending)
            decodes += costly
        return batch

    def _made(self, batch: list[_Pending], fut: asyncio.Future) -> None:
        loop = fut.get_loop()
        results = None if fut.cancelled() or fut.exception() is not None else fut.result()
        for i, pending in enumerate(batch):
            one = loop.create_future()
            if fut.cancelled():
                one.cancel()
            elif results is None:
                one.set_exception(fut.exception())
            elif isinstance(results[i], BaseException):
                one.set_exception(results[i])
            else:
                one.set_result(results[i])
            try:
                self._on_made(pending.stream, pending.began, one)
            except Exception:  # noqa: BLE001 - the other streams of the batch still get theirs
                log.exception("handling a made decoder state failed")
