"""What one decode call costs on this replica's GPU, measured from its own calls.

A call of `frames` frames (every stream's chunk in one batch together) takes about
`call_s + frame_s * frames`: a weighted least-squares fit over the recent calls (exponentially
decayed sums, so it follows a GPU that the talker shares), and `calls_per_s`, how often it calls.
The servicer publishes them on every credit grant (`code2wav.v1.CreditGrant`): a talker on the
same GPU counts them in its admission (services/talker/admission.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCostEstimate:
    """Seconds a decode call costs on top of its frames, seconds per frame, and calls a second."""

    call_s: float
    frame_s: float
    calls_per_s: float


class DecodeCost:
    """Exponentially weighted fit of decode time against frames per call."""

    def __init__(self, memory_calls: int = 200, max_gap_s: float = 1.0):
        if memory_calls < 2 or max_gap_s <= 0:
            raise ValueError("memory_calls must be >= 2 and max_gap_s > 0")
        self._keep = 1.0 - 1.0 / memory_calls
        self._max_gap_s = max_gap_s
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._gaps_s = 0.0  # decayed sum of the gaps between calls (each at most max_gap_s)
        self._gaps = 0.0  # and their decayed count
        self._last_at: float | None = None

    def observe(self, frames: int, seconds: float, now: float) -> None:
        """One decode call of `frames` frames took `seconds`, ending at clock time `now`."""
        if frames <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        k = self._keep
        x, y = float(frames), float(seconds)
        self._w = self._w * k + 1.0
        self._x = self._x * k + x
        self._y = self._y * k + y
        self._xx = self._xx * k + x * x
        self._xy = self._xy * k + x * y
        if self._last_at is not None:
            self._gaps_s = self._gaps_s * k + min(max(now - self._last_at, 0.0), self._max_gap_s)
            self._gaps = self._gaps * k + 1.0
        self._last_at = now

    def estimate(self) -> DecodeCostEstimate | None:
        """The fitted cost (None before the first call). While every call had one size, the
        whole of a call's time is put on its frames (a per-call part cannot be told apart)."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        call_s, frame_s = 0.0, my / mx
        if var > 1e-9 * mx * mx:
            slope = (self._xy / self._w - mx * my) / var
            if slope > 0 and my - slope * mx >= 0:
                call_s, frame_s = my - slope * mx, slope
            elif slope > 0:  # a negative intercept: a line through the origin
                frame_s = self._xy / self._xx
        rate = self._gaps / self._gaps_s if self._gaps_s > 0 else 0.0
        return DecodeCostEstimate(call_s, frame_s, rate)
