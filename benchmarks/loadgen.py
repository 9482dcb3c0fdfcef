"""Load patterns: closed loop at a fixed concurrency, open loop with seeded Poisson arrivals, and the
per-request audio length (`LengthDistribution`: one fixed length, or a seeded 2-20 s mix).

Both drivers call `send(index)` for request `index` (0, 1, 2, ...) and collect the `RequestRecord`
it returns. `send` stamps `start_s` with `time.perf_counter()`; the drivers rebase it to the start
of the level. A hard deadline (a `time.perf_counter()` instant) stops launching requests and cancels
the ones still in flight; those are counted as aborted, not as failures of the server.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from benchmarks.metrics import REFUSAL_STATUSES, RequestRecord

SendFn = Callable[[int], Awaitable[RequestRecord]]
DoneFn = Callable[[RequestRecord], None]

# Qwen3-TTS-12Hz: one codec frame is 80 ms of audio.
FRAMES_PER_SECOND = 12.5
MIXED_DEFAULT_MEAN_S = 4.8
# Spread of log(length): with a 2-20 s window and a 4.8 s mean, the median is about 4.1 s, the
# 95th percentile about 10 s and the 99th about 14 s.
MIXED_LOG_SIGMA = 0.6
_STD_NORMAL = NormalDist()


@dataclass
class LevelRun:
    """The records of one load level and how long it took."""

    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    aborted: int = 0
    hit_deadline: bool = False
    # How late the client's own event loop woke, sampled every `LOOP_LAG_EVERY_S` while the level
    # ran (seconds; every client process's samples): a busy client stamps its requests' times
    # late, and its refusal and first-audio figures are then its own, not the server's.
    loop_lag_s: list[float] = field(default_factory=list)


LOOP_LAG_EVERY_S = 0.02


async def sample_loop_lag(into: list[float], every_s: float = LOOP_LAG_EVERY_S) -> None:
    """Append to `into` how late each `every_s` sleep of this event loop wakes, until cancelled."""
    while True:
        began = time.perf_counter()
        await asyncio.sleep(every_s)
        into.append(max(0.0, time.perf_counter() - began - every_s))


def retry_after_backoff(record: RequestRecord) -> float:
    """How long a refused request's worker waits before its next one: the server's Retry-After
    (`extra["retry_after_s"]`, 1 s when it gave none); 0 for any other record."""
    if record.status not in REFUSAL_STATUSES:
        return 0.0
    return float(record.extra.get("retry_after_s") or 1.0)


def poisson_arrivals(
    rate: float, *, count: int | None = None, duration_s: float | None = None, seed: int = 0
) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process at `rate` requests/s.

    Give `count` (that many arrivals) or `duration_s` (every arrival before it), or both (whichever
    ends first). The same seed gives the same schedule.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    if count is None and duration_s is None:
        raise ValueError("give count or duration_s")
    rng = np.random.default_rng(seed)
    arrivals: list[float] = []
    t = 0.0
    while count is None or len(arrivals) < count:
        t += float(rng.exponential(1.0 / rate))
        if duration_s is not None and t >= duration_s:
            break
        arrivals.append(t)
    return arrivals


def _truncated_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """Mean of exp(N(mu, sigma^2)) conditioned on lying in [lo, hi]."""
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    mass = _STD_NORMAL.cdf(b) - _STD_NORMAL.cdf(a)
    if mass <= 0.0:
        # All the mass is beyond one bound (|mu| far out of range): the mean sits at that bound.
        return lo if b <= 0 else hi
    shifted = _STD_NORMAL.cdf(b - sigma) - _STD_NORMAL.cdf(a - sigma)
    return math.exp(mu + sigma * sigma / 2) * shifted / mass


@dataclass(frozen=True)
class LengthDistribution:
    """How long each request's audio is asked to be (sent as its max_new_tokens).

    `fixed` (the default): every request gets `--max-new-tokens` (or no limit when that is unset).
    `mixed:LO:HI[:MEAN]`: per-request lengths in seconds from a log-normal truncated to [LO, HI]
    (draws outside are not clipped onto the bounds but redrawn, i.e. sampled by inverse CDF within
    the window), log-sigma 0.6, its location solved so that the truncated mean is MEAN (default
    4.8 s). `mixed:2:20` therefore gives mostly short replies (median about 4.1 s) with a tail to
    20 s. Seconds become frames at 12.5 frames/s, rounded, and kept inside the window.
    """

    spec: str = "fixed"
    lo_s: float | None = None
    hi_s: float | None = None
    mean_s: float | None = None
    sigma: float = MIXED_LOG_SIGMA

    @property
    def is_fixed(self) -> bool:
        return self.lo_s is None

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        text = spec.strip().lower()
        if text == "fixed":
            return cls()
        parts = text.split(":")
        if parts[0] != "mixed" or len(parts) not in (3, 4):
            raise ValueError(f"--length-dist {spec!r}: use fixed or mixed:LO:HI[:MEAN] (seconds)")
        try:
            lo, hi = float(parts[1]), float(parts[2])
            mean = float(parts[3]) if len(parts) == 4 else MIXED_DEFAULT_MEAN_S
        except ValueError:
            raise ValueError(f"--length-dist {spec!r}: LO, HI and MEAN must be numbers") from None
        if not (lo * FRAMES_PER_SECOND >= 1 and lo < mean < hi and math.isfinite(hi)):
            raise ValueError(
                f"--length-dist {spec!r}: need {1 / FRAMES_PER_SECOND:g} s <= LO < MEAN < HI "
                f"(MEAN defaults to {MIXED_DEFAULT_MEAN_S:g} s)"
            )
        return cls(spec=text, lo_s=lo, hi_s=hi, mean_s=mean)

    @property
    def mu(self) -> float:
        """Location of log(length) giving the target truncated mean (bisection; the mean rises with mu)."""
        assert self.lo_s is not None and self.hi_s is not None and self.mean_s is not None
        low, high = math.log(self.lo_s) - 10 * self.sigma, math.log(self.hi_s) + 10 * self.sigma
        for _ in range(200):
            mid = (low + high) / 2
            if _truncated_lognormal_mean(mid, self.sigma, self.lo_s, self.hi_s) < self.mean_s:
                low = mid
            else:
                high = mid
        return (low + high) / 2

    def seconds(self, count: int, seed: int = 0) -> list[float]:
        """`count` lengths in seconds; the same seed gives the same lengths, and a longer list starts
        with the shorter one (so every level of a run sees the same lengths for the same indices)."""
        if self.is_fixed:
            raise ValueError("a fixed length distribution has no per-request draws")
        assert self.lo_s is not None and self.hi_s is not None
        mu, sigma = self.mu, self.sigma
        lo_cdf = _STD_NORMAL.cdf((math.log(self.lo_s) - mu) / sigma)
        hi_cdf = _STD_NORMAL.cdf((math.log(self.hi_s) - mu) / sigma)
        # Its own stream: seeding with `seed` alone would replay the Poisson arrivals' draws.
        uniforms = np.random.default_rng([seed, 0x4C454E]).random(count)
        out = []
        for u in uniforms:
            p = min(max(lo_cdf + float(u) * (hi_cdf - lo_cdf), 1e-300), 1.0 - 1e-16)
            x = math.exp(mu + sigma * _STD_NORMAL.inv_cdf(p))
            out.append(min(max(x, self.lo_s), self.hi_s))
        return out

    def frames(self, count: int, seed: int = 0) -> list[int]:
        """`count` per-request frame counts (12.5 per second), inside [LO, HI] seconds."""
        seconds = self.seconds(count, seed)
        assert self.lo_s is not None and self.hi_s is not None
        lo_f = math.ceil(self.lo_s * FRAMES_PER_SECOND - 1e-9)
        hi_f = math.floor(self.hi_s * FRAMES_PER_SECOND + 1e-9)
        return [min(max(round(s * FRAMES_PER_SECOND), lo_f), hi_f) for s in seconds]

    def describe(self) -> dict[str, Any]:
        """The distribution as recorded with the results' conditions."""
        if self.is_fixed:
            return {"spec": self.spec, "kind": "fixed (--max-new-tokens for every request)"}
        return {
            "spec": self.spec,
            "kind": "truncated log-normal",
            "lo_s": self.lo_s,
            "hi_s": self.hi_s,
            "target_mean_s": self.mean_s,
            "log_sigma": self.sigma,
            "log_mu": self.mu,
            "frames_per_second": FRAMES_PER_SECOND,
        }


def length_stats(frames: Sequence[int | None]) -> dict[str, Any] | None:
    """Realised requested lengths (frames and seconds) of the requests sent; None when unbounded."""
    values = [f for f in frames if f is not None]
    if not values:
        return None
    return {
        "num_requests": len(values),
        "mean_s": sum(values) / len(values) / FRAMES_PER_SECOND,
        "min_s": min(values) / FRAMES_PER_SECOND,
        "max_s": max(values) / FRAMES_PER_SECOND,
        "mean_frames": sum(values) / len(values),
        "min_frames": min(values),
        "max_frames": max(values),
    }


class _Collector:
    """Shared bookkeeping of a level: records, rebased start times, in-flight count."""

    def __init__(self, send: SendFn, on_done: DoneFn | None):
        self.t0 = time.perf_counter()
        self.run = LevelRun()
        self.in_flight = 0
        self._send = send
        self._on_done = on_done
        self._lag = asyncio.create_task(sample_loop_lag(self.run.loop_lag_s))

    async def one(self, index: int) -> RequestRecord:
        self.in_flight += 1
        try:
            record = await self._send(index)
        finally:
            self.in_flight -= 1
        record.start_s -= self.t0
        self.run.records.append(record)
        if self._on_done is not None:
            self._on_done(record)
        return record

    async def finish(self, tasks: Sequence[asyncio.Task], deadline: float | None) -> LevelRun:
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        try:
            _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        finally:
            self._lag.cancel()
        if pending:
            self.run.hit_deadline = True
            self.run.aborted = self.in_flight
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        # Read every task's exception (so none is reported as never retrieved), then raise the first:
        # send() turns failed requests into records, so an exception here is a bug.
        errors = [t.exception() for t in tasks if t.done() and not t.cancelled()]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        self.run.wall_s = time.perf_counter() - self.t0
        self.run.records.sort(key=lambda r: r.index)
        return self.run


async def run_closed_loop(
    send: SendFn,
    *,
    concurrency: int,
    num_requests: int,
    deadline: float | None = None,
    on_done: DoneFn | None = None,
    backoff: Callable[[RequestRecord], float] | None = None,
) -> LevelRun:
    """`concurrency` workers each send the next request as soon as their previous one ends, or
    `backoff(record)` seconds after it (a refused client waiting the server's Retry-After)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    collector = _Collector(send, on_done)
    indices = iter(range(num_requests))

    async def worker() -> None:
        # One shared iterator: each index is taken by exactly one worker.
        for index in indices:
            record = await collector.one(index)
            wait = backoff(record) if backoff is not None else 0.0
            if wait > 0:
                await asyncio.sleep(wait)

    tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, num_requests))]
    return await collector.finish(tasks, deadline)


async def run_open_loop(
    send: SendFn,
    arrivals: Sequence[float],
    *,
    deadline: float | None = None,
    on_done: DoneFn | None = None,
) -> LevelRun:
    """Send request i at `arrivals[i]` seconds after the start, whether or not others finished."""
    collector = _Collector(send, on_done)
    launched: list[asyncio.Task] = []

    async def dispatcher() -> None:
        for index, offset in enumerate(arrivals):
            delay = collector.t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            launched.append(asyncio.create_task(collector.one(index)))

    dispatch = asyncio.create_task(dispatcher())
    timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
    done, _ = await asyncio.wait([dispatch], timeout=timeout)
    if not done:
        dispatch.cancel()
        await asyncio.gather(dispatch, return_exceptions=True)
        collector.run.hit_deadline = True
    else:
        dispatch.result()
    return await collector.finish(launched, deadline)
