"""How long a service took to start, phase by phase.

A replica that takes three minutes to report SERVING is three minutes of a scale-out in which the
new pod carries nothing, so each service says where its start-up went: every phase is logged as
it ends ("start-up: load the decoder and capture its graphs took 93.4 s") and exported as
`tts_startup_seconds{service, phase}`, and the first SERVING adds the phase "serving": the time
from the process's start (the kernel's record of it, so interpreter and import time count) to
that moment.

    startup = metrics.startup
    with startup.phase("load the model"):
        ...
    startup.serving()        # GrpcServiceHost.set_serving calls this the first time

Phases that ran in another process (the talker's engine process) arrive as a dict and are
recorded with `record_all(prefix=...)`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)


def process_age_s() -> float | None:
    """Seconds since this process started, from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # Field 22 (starttime, in clock ticks since boot) counts from after the command's ")".
        start_ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupPhases:
    """The phases of one service's start-up, logged and exported as they end."""

    def __init__(self, registry: CollectorRegistry | None, service: str):
        self.service = service
        self.phases: dict[str, float] = {}
        self._created = time.monotonic()
        self._age_at_creation = process_age_s()
        self._gauge = (
            Gauge(
                "tts_startup_seconds",
                "How long each phase of this service's start-up took; phase 'serving' is the time "
                "from the process's start to its first SERVING.",
                ["service", "phase"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def record(self, phase: str, seconds: float) -> None:
        self.phases[phase] = seconds
        if self._gauge is not None:
            self._gauge.labels(self.service, phase).set(seconds)
        log.info("start-up: %s took %.1f s", phase, seconds)

    def record_all(self, phases: Mapping[str, float], prefix: str = "") -> None:
        for phase, seconds in phases.items():
            self.record(prefix + phase, seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as phase `name` (recorded only when it completes)."""
        start = time.monotonic()
        yield
        self.record(name, time.monotonic() - start)

    def since_process_start(self) -> float:
        """Seconds since the process started (since this object was made where /proc is missing)."""
        base = self._age_at_creation or 0.0
        return base + time.monotonic() - self._created

    def serving(self) -> None:
        """The first SERVING: record the time since the process started (later calls: no-op)."""
        if "serving" not in self.phases:
            self.record("serving", self.since_process_start())
