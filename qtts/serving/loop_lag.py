"""How late a service's event loop runs what is due: `tts_event_loop_lag_seconds`.

Every service relays streams on one asyncio loop (gRPC messages, HTTP bodies, credits, timers).
When that loop is busy, everything on it waits: a chunk handed on late, a refusal sent seconds
after it was decided, a credit that holds a stream back. The stage histograms time work once it
runs; this one times the wait before it runs. A task asks to wake every `interval_s` and records
how much later than asked it woke: near zero on an idle loop, the length of the callbacks queued
ahead of it on a busy one. (The wait of a message that arrives is the same wait: the loop takes
ready callbacks in order.)

`GrpcServiceHost` starts one per service from `start()` and stops it in `stop()`; the gateway's HTTP
and gRPC share the loop, so one sampler sees both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

log = logging.getLogger(__name__)

# From a timer's normal jitter (well under a millisecond) to a loop stalled for seconds.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoopLagMonitor:
    """Samples the lag of the running loop into a histogram and keeps the worst one since the
    last scrape in a gauge (a spike between two scrapes shows in the gauge, not only as a count
    in a bucket)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        service: str,
        interval_s: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self._clock = clock
        self.lag_seconds = Histogram(
            "tts_event_loop_lag_seconds",
            "How much later than due the service's event loop ran a timer (sampled every "
            "interval): the wait every message and callback on that loop has at that moment.",
            ["service"],
            buckets=LAG_BUCKETS,
            registry=registry,
        ).labels(service)
        self._worst = 0.0
        self.worst_seconds = Gauge(
            "tts_event_loop_lag_max_seconds",
            "The longest event-loop lag sampled since the previous scrape of this gauge.",
            ["service"],
            registry=registry,
        )
        self.worst_seconds.labels(service).set_function(self._take_worst)
        self._task: asyncio.Task | None = None

    def _take_worst(self) -> float:
        worst, self._worst = self._worst, 0.0
        return worst

    def observe(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        self.lag_seconds.observe(lag_s)
        self._worst = max(self._worst, lag_s)

    def start(self) -> None:
        """Start sampling on the running loop (again after `stop()`; a no-op while running)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sample(), name="event-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sample(self) -> None:
        while True:
            due = self._clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.observe(self._clock() - due)
