"""What one decode call costs on this replica's GPU, measured from its own calls.

A call of `frames` frames (every stream's chunk in one batch together) takes about
`call_s + frame_s * frames`, and the replica makes `calls_per_s` of them. The servicer publishes
them on every credit grant (`code2wav.v1.CreditGrant`): a talker on the same GPU counts them in
its admission (services/talker/admission.py).

The fit is of the calls' lower envelope, not their mean: a least-squares line over the recent
calls, then again over the quarter of them furthest below it. On a GPU the talker shares, a call
that ran beside a frame step took longer (the issue's open loop: 13.5 ms a call against about
3 ms alone), and the talker's own step times already include that contention; counting the
decoder's contended time too would count the overlap twice and halve the capacity admission
allows. The calls made while the GPU was free (the talker steps about once a frame, in one wide
batch, and leaves the GPU free in between) say what the decoder itself costs.

A burst can leave no such call in memory: while a closed loop's opening (768 requests in a
third of a second) is prefilled, every decode call runs beside a prefill-heavy step. On an H100
(bdbd10a) the envelope then read 65 us a frame where the decoder costs 19 us alone, and the
talker, counting each stream's decode at that, let in 525 of 768. The start-up calibration is the
decoder alone on this GPU, so the published cost a frame is held within a ceiling over it
(`--decode-cost-ceiling`, default `CONTENTION_CEILING`); the per-call part, 4.5% of the GPU in
that burst, is published as fitted. On a steady load the envelope ran 1.24-1.45x the calibration
(two H100 stacks; narrower calls than its wide one), which the ceiling leaves as measured.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DecodeCostEstimate:
    """Seconds a decode call costs on top of its frames, seconds per frame, and calls a second."""

    call_s: float
    frame_s: float
    calls_per_s: float


# Each calibration call is made this many times (Code2WavCore.calibrate).
CALIBRATION_REPEATS = 3


def calibration_calls(chunk_frames: int, max_streams: int) -> list[tuple[int, int]]:
    """(streams, frames each) of the decode calls a replica times at start-up: one frame of one
    stream, one chunk of one, and up to 64 streams' chunks at once, sizes far enough apart for
    the fit to tell a frame's cost from a call's."""
    return [(1, 1), (1, chunk_frames), (max(1, min(max_streams, 64)), chunk_frames)]


def _spans(frames: np.ndarray, spread: float, span: float) -> bool:
    """Do the calls' sizes differ enough for their line to measure a per-frame cost?"""
    lo, hi = float(frames.min()), float(frames.max())
    return hi >= spread * lo and hi - lo >= span


def _fit(frames: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(call_s, frame_s) of a least-squares line, both >= 0; calls of one size put the whole of
    a call's time on its frames (a per-call part cannot be told apart)."""
    mx, my = float(frames.mean()), float(seconds.mean())
    var = float(((frames - mx) ** 2).mean())
    if var > 1e-9 * mx * mx:
        slope = float(((frames - mx) * (seconds - my)).mean()) / var
        if slope > 0 and my - slope * mx >= 0:
            return my - slope * mx, slope
        if slope > 0:  # a negative intercept: a line through the origin
            return 0.0, float((frames * seconds).sum() / (frames * frames).sum())
    return 0.0, my / mx


class DecodeCost:
    """The lower-envelope fit of decode time against frames over the last `memory_calls` calls,
    refitted at most every `refit_s` of the clock (the servicer asks on every grant)."""

    LOWER_SHARE = 0.25  # the share of calls, furthest below the first fit, that the second one uses
    MIN_LOWER = 8
    # Calls whose sizes span this factor and this many frames measure the per-frame cost.
    MIN_SPREAD = 4.0
    MIN_SPAN_FRAMES = 64
    # The published per-frame cost is at most this factor over the calibration's by default
    # (`--decode-cost-ceiling`). Not the per-call part: an idle replica's one-stream calls cost
    # more a call than the wide ones.
    CONTENTION_CEILING = 1.5

    @staticmethod
    def ceiling_ok(ceiling: float) -> bool:
        """Whether `ceiling` is a contention ceiling: 0 (none) or a finite factor >= 1."""
        return ceiling == 0 or 1 <= ceiling < math.inf

    def __init__(
        self,
        memory_calls: int = 200,
        max_gap_s: float = 1.0,
        refit_s: float = 0.05,
        contention_ceiling: float = CONTENTION_CEILING,
    ):
        if memory_calls < 2 or max_gap_s <= 0 or refit_s < 0:
            raise ValueError("memory_calls must be >= 2, max_gap_s > 0 and refit_s >= 0")
        if not self.ceiling_ok(contention_ceiling):
            raise ValueError(f"contention_ceiling must be 0 (none) or >= 1, got {contention_ceiling}")
        self._ceiling = contention_ceiling
        self._calls: deque[tuple[float, float]] = deque(maxlen=memory_calls)  # (frames, seconds)
        self._gaps: deque[float] = deque(maxlen=memory_calls)  # between calls, each <= max_gap_s
        self._max_gap_s = max_gap_s
        self._refit_s = refit_s
        self._last_at: float | None = None
        self._fitted_at = -math.inf
        self._estimate: DecodeCostEstimate | None = None
        # Seconds a frame, from the last fit over calls of sizes far enough apart (None: none yet).
        self._frame_s: float | None = None
        # The calibration's fit, the decoder alone (None: not calibrated).
        self._alone: DecodeCostEstimate | None = None

    def observe(self, frames: int, seconds: float, now: float) -> None:
        """One decode call of `frames` frames took `seconds`, ending at clock time `now`."""
        if not self._add(frames, seconds):
            return
        if self._last_at is not None:
            self._gaps.append(min(max(now - self._last_at, 0.0), self._max_gap_s))
        self._last_at = now
        if now - self._fitted_at >= self._refit_s or self._estimate is None:
            self._fitted_at = now
            self._estimate = self._refit()

    def calibrate(self, frames: int, seconds: float) -> None:
        """A decode call made to measure the decoder (start-up, before any stream): counted in
        the fit, not in the call rate (calls made back to back say nothing about how often
        streams need one); the fit of these calls bounds the published cost from then on."""
        if self._add(frames, seconds):
            self._alone = None
            self._estimate = self._alone = self._refit()

    def _add(self, frames: int, seconds: float) -> bool:
        """Keep a call for the fit; False (and nothing kept) for one with no frames or no time."""
        if frames <= 0 or not math.isfinite(seconds) or seconds < 0:
            return False
        self._calls.append((float(frames), float(seconds)))
        return True

    def estimate(self) -> DecodeCostEstimate | None:
        """The cost as last fitted (None before the first call)."""
        return self._estimate

    def _line(self, frames: np.ndarray, seconds: np.ndarray, keep_slope: bool) -> tuple[float, float]:
        """(call_s, frame_s): a free line over calls of sizes far enough apart (remembering its
        per-frame cost when `keep_slope`), else the last such per-frame cost (at most the mean
        cost of a frame here) with the calls' mean setting the per-call part."""
        spans = _spans(frames, self.MIN_SPREAD, self.MIN_SPAN_FRAMES)
        if self._frame_s is None or spans:
            call_s, frame_s = _fit(frames, seconds)
            if keep_slope and spans:
                self._frame_s = frame_s
            return call_s, frame_s
        mx, my = float(frames.mean()), float(seconds.mean())
        frame_s = min(self._frame_s, my / mx)
        return my - frame_s * mx, frame_s

    def _refit(self) -> DecodeCostEstimate:
        data = np.asarray(self._calls)
        frames, seconds = data[:, 0], data[:, 1]
        lower = max(self.MIN_LOWER, int(len(data) * self.LOWER_SHARE))
        call_s, frame_s = self._line(frames, seconds, keep_slope=len(data) <= lower)
        if len(data) > lower:
            residual = seconds - (call_s + frame_s * frames)
            keep = np.argsort(residual, kind="stable")[:lower]
            call_s, frame_s = self._line(frames[keep], seconds[keep], keep_slope=True)
        if self._alone is not None and self._alone.frame_s > 0 and self._ceiling:
            frame_s = min(frame_s, self._ceiling * self._alone.frame_s)
        gaps = sum(self._gaps)
        rate = len(self._gaps) / gaps if gaps > 0 else 0.0
        return DecodeCostEstimate(call_s, frame_s, rate)
