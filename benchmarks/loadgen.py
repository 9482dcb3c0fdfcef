"""Load patterns: closed loop at a fixed concurrency, open loop with seeded Poisson arrivals.

Both drivers call `send(index)` for request `index` (0, 1, 2, ...) and collect the `RequestRecord`
it returns. `send` stamps `start_s` with `time.perf_counter()`; the drivers rebase it to the start
of the level. A hard deadline (a `time.perf_counter()` instant) stops launching requests and cancels
the ones still in flight; those are counted as aborted, not as failures of the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.metrics import RequestRecord

SendFn = Callable[[int], Awaitable[RequestRecord]]
DoneFn = Callable[[RequestRecord], None]


@dataclass
class LevelRun:
    """The records of one load level and how long it took."""

    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    aborted: int = 0
    hit_deadline: bool = False


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


class _Collector:
    """Shared bookkeeping of a level: records, rebased start times, in-flight count."""

    def __init__(self, send: SendFn, on_done: DoneFn | None):
        self.t0 = time.perf_counter()
        self.run = LevelRun()
        self.in_flight = 0
        self._send = send
        self._on_done = on_done

    async def one(self, index: int) -> None:
        self.in_flight += 1
        try:
            record = await self._send(index)
        finally:
            self.in_flight -= 1
        record.start_s -= self.t0
        self.run.records.append(record)
        if self._on_done is not None:
            self._on_done(record)

    async def finish(self, tasks: Sequence[asyncio.Task], deadline: float | None) -> LevelRun:
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
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
) -> LevelRun:
    """`concurrency` workers each send the next request as soon as their previous one ends."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    collector = _Collector(send, on_done)
    indices = iter(range(num_requests))

    async def worker() -> None:
        # One shared iterator: each index is taken by exactly one worker.
        for index in indices:
            await collector.one(index)

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
