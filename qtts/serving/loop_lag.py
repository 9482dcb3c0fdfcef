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

A stall says how long, not why. With `stall_dump_s` (the environment's `TTS_STALL_DUMP_MS`, off by
default) a watchdog thread looks at the sampler's next due time every `stall_dump_s / 4`: a loop
that has not woken `stall_dump_s` after it was due gets the Python stack its thread is in logged,
while the stall lasts (`sys._current_frames`, read holding the GIL, which a Python thread running
the loop yields every switch interval), and a warning with the stall's length once the loop runs
again. At most `MAX_STALL_DUMPS` a process. (faulthandler's watchdog reads the threads' frames
without the GIL; it killed a gateway of the CPU stand-in stack mid-dump under a burst.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

log = logging.getLogger(__name__)

# From a timer's normal jitter (well under a millisecond) to a loop stalled for seconds.
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STALL_DUMP_ENV = "TTS_STALL_DUMP_MS"
MAX_STALL_DUMPS = 20


def stall_dump_s_from_env() -> float:
    """`TTS_STALL_DUMP_MS` in seconds (0: unset or 0, no dumps); a value that is not a number >= 0
    is an error at start-up, not a silent off."""
    raw = os.environ.get(STALL_DUMP_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{STALL_DUMP_ENV} must be milliseconds (a number >= 0), got {raw!r}") from None
    if not ms >= 0:
        raise ValueError(f"{STALL_DUMP_ENV} must be milliseconds (a number >= 0), got {raw!r}")
    return ms / 1e3


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
        stall_dump_s: float | None = None,
    ):
        """`stall_dump_s`: log the loop thread's stack when the loop is this late (None: from
        `TTS_STALL_DUMP_MS`; 0: never)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.interval_s = interval_s
        self._clock = clock
        self.stall_dump_s = stall_dump_s_from_env() if stall_dump_s is None else stall_dump_s
        if self.stall_dump_s < 0:
            raise ValueError("stall_dump_s must be >= 0")
        self.stall_dumps = 0  # stacks logged so far
        # The sampler's next due time and its loop's thread, read by the watchdog thread.
        self._due: float | None = None
        self._loop_thread: int | None = None
        self._dumped_due: float | None = None  # the due time whose stall was logged
        self._watchdog: threading.Thread | None = None
        self._watchdog_stop = threading.Event()
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

    def _watch(self) -> None:
        """The watchdog thread: log the loop thread's stack once a due time is `stall_dump_s` past."""
        while not self._watchdog_stop.wait(self.stall_dump_s / 4):
            due, thread = self._due, self._loop_thread
            if due is None or thread is None or due == self._dumped_due:
                continue
            late = self._clock() - due
            if late < self.stall_dump_s or self.stall_dumps >= MAX_STALL_DUMPS:
                continue
            frame = sys._current_frames().get(thread)
            if frame is None:
                continue
            self._dumped_due = due
            self.stall_dumps += 1
            stack = "".join(traceback.format_stack(frame))
            del frame
            log.warning(
                "the event loop is %.0f ms late; its thread's stack (%d of at most %d):\n%s",
                late * 1e3,
                self.stall_dumps,
                MAX_STALL_DUMPS,
                stack.rstrip("\n"),
            )

    async def _sample(self) -> None:
        if self.stall_dump_s:
            self._loop_thread = threading.get_ident()
            self._watchdog_stop.clear()
            self._watchdog = threading.Thread(
                target=self._watch, name="event-loop-stall-watchdog", daemon=True
            )
            self._watchdog.start()
        try:
            while True:
                due = self._clock() + self.interval_s
                self._due = due
                await asyncio.sleep(self.interval_s)
                lag = self._clock() - due
                if self._dumped_due == due:
                    log.warning("the event loop stalled %.0f ms (its stack is logged above)", lag * 1e3)
                self.observe(lag)
        finally:
            self._due = None
            if self._watchdog is not None:
                self._watchdog_stop.set()
                self._watchdog.join(1.0)
                self._watchdog = None
