"""The listener's playback clock as the gateway sees it: server-side underruns at the last hop.

Playback starts when the first chunk has been handed to the client's connection and consumes audio
in real time (the client's underrun definition, BENCHMARKS.md). A later chunk handed on after the
audio before it ran out is a gap the listener hears, unless the network or the client makes it up.
The talker measures the same thing one hop earlier; comparing the two places a gap on the
talker -> gateway side or on the gateway -> client side.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from qtts.request.vocabulary import NATIVE_SAMPLE_RATE
from qtts.serving.metrics import GatewayMetrics


class PlaybackClock:
    """Call `handed_on(samples)` once a chunk of `samples` talker samples is on the connection."""

    def __init__(
        self, metrics: GatewayMetrics, speed: float = 1.0, clock: Callable[[], float] = time.perf_counter
    ):
        self._metrics = metrics
        self._speed = speed if speed > 0 else 1.0
        self._clock = clock
        self._first_at: float | None = None
        self._delivered_s = 0.0

    def handed_on(self, samples: int) -> None:
        if samples <= 0:
            return
        now = self._clock()
        if self._first_at is None:
            self._first_at = now
        else:
            slack = self._delivered_s - (now - self._first_at)
            self._metrics.deadline_slack_seconds.observe(slack)
            if slack < 0:
                self._metrics.underruns_total.inc()
        self._delivered_s += samples / NATIVE_SAMPLE_RATE / self._speed
