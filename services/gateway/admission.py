"""Admission control: a bound on concurrent synthesis streams, rejecting (not queueing) beyond it."""

from __future__ import annotations

from qtts.errors import ResourceExhausted


class Admission:
    """Counts admitted streams; `admit()` fails at once when `max_streams` are in progress.

    Rejecting immediately (429 / RESOURCE_EXHAUSTED) rather than queueing keeps the latency of every
    admitted stream bounded and lets a load balancer retry elsewhere.
    """

    def __init__(self, max_streams: int):
        if max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        self.max_streams = max_streams
        self._active = 0

    @property
    def active(self) -> int:
        return self._active

    def admit(self) -> None:
        if self._active >= self.max_streams:
            raise ResourceExhausted(
                f"server is at its limit of {self.max_streams} concurrent streams; retry later"
            )
        self._active += 1

    def release(self) -> None:
        if self._active <= 0:
            raise RuntimeError("release() without admit()")
        self._active -= 1
