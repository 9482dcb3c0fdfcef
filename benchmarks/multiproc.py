"""One load level driven by several client processes.

A single Python client reading hundreds of streamed responses can fall behind them: its own event
loop lag then reads as gaps in the audio. With `--processes N` every level's requests are split
over N worker processes: request i of the level goes to worker i mod N (so every level still walks
the same prompt, seed and length sequence), closed-loop slots are split as evenly as possible, and
open-loop arrival i keeps its time. All workers start together: at one moment of the host's
monotonic clock (`time.perf_counter` is CLOCK_MONOTONIC on Linux, shared by every process), or,
when a worker is not ready by then, once every worker is (a barrier). Without the barrier a worker
that missed the moment started alone when it was ready: on an H100 host busy with a stack, all
eight workers of a c=768 level missed it and started over 0.2-2.6 s, so the closed loop's opening
came in waves, and the gateways the late workers sent to refused most of what was refused
(benchmarks/HISTORY.md, fourth session of 2026-12-07). Their records are merged back into one
level with start times on one time base.

Each worker warms its own client (`warm`: a health check through the same connection pool or
channels, no synthesis) while it waits for the common start, so its first request does not pay
the connect and first-use costs: 120-215 ms of extra first-audio time on exactly the first request
of every worker (against 45 ms for the rest, 1 req/s over 4 processes) before this.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.loadgen import LevelRun, retry_after_backoff, run_closed_loop, run_open_loop
from benchmarks.metrics import RequestRecord
from benchmarks.transport import warm_or_log

START_DELAY_S = 2.0  # room for every worker to import, load the reference clip and warm its client
# A worker past the common moment still warms its client this long (the others wait for it).
LATE_WARM_S = 1.0
# How long the workers wait at the barrier for the last one before starting without it.
BARRIER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LevelSpec:
    """What one level sends: `total` requests, closed loop over `concurrency` slots or open loop at
    `arrivals` (seconds after the level's start); `offset` keeps seeds and ids unique per level."""

    mode: str
    total: int
    offset: int
    concurrency: int | None = None
    arrivals: tuple[float, ...] = ()


# (args, spec) -> (send(level index) -> record, close, warm): one worker's client for a level;
# `warm()` readies the client without synthesis (see `Synthesizer.warm`).
SenderFactory = Callable[
    [argparse.Namespace, "LevelSpec"],
    tuple[
        Callable[[int], Awaitable[RequestRecord]],
        Callable[[], Awaitable[None]],
        Callable[[], Awaitable[None]],
    ],
]


def shard(spec: LevelSpec, worker: int, processes: int) -> tuple[list[int], int | None, list[float]]:
    """(the level indices worker `worker` sends, its closed-loop slots, its arrival times)."""
    indices = list(range(worker, spec.total, processes))
    slots = None
    if spec.concurrency is not None:
        slots = spec.concurrency // processes + (1 if worker < spec.concurrency % processes else 0)
    arrivals = [spec.arrivals[i] for i in indices] if spec.arrivals else []
    return indices, slots, arrivals


def merge(parts: Sequence[tuple[float, LevelRun]]) -> LevelRun:
    """One level from the workers' (start time, run): start times rebased on the earliest start."""
    t0 = min(start for start, _ in parts)
    merged = LevelRun()
    end = t0
    for start, run in parts:
        for record in run.records:
            merged.records.append(replace(record, start_s=record.start_s + start - t0))
        merged.aborted += run.aborted
        merged.loop_lag_s.extend(run.loop_lag_s)
        merged.hit_deadline = merged.hit_deadline or run.hit_deadline
        end = max(end, start + run.wall_s)
    merged.wall_s = end - t0
    merged.records.sort(key=lambda r: r.index)
    return merged


async def _drive(
    args: argparse.Namespace,
    spec: LevelSpec,
    worker: int,
    processes: int,
    start_at: float,
    deadline_in_s: float | None,
    make_sender: SenderFactory,
    ready: Callable[[], object] | None = None,
) -> tuple[float, LevelRun]:
    """One worker's share of a level. `ready` (blocking) returns once every worker has called it:
    the barrier that keeps a worker that missed `start_at` from starting alone."""
    send_global, aclose, warm = make_sender(args, spec)  # the worker's own client
    try:
        indices, slots, arrivals = shard(spec, worker, processes)
        idle = not indices or (spec.mode == "closed" and not slots)

        async def send(local: int) -> RequestRecord:
            record = await send_global(indices[local])
            return record

        # Within the wait for the common start; a worker past it warms briefly (the others wait).
        remaining = start_at - time.perf_counter()
        if not idle:
            await warm_or_log(warm, max(remaining, LATE_WARM_S), f"client process {worker}")
        if ready is not None:  # every worker, an idle one too: the barrier counts them all
            try:
                await asyncio.to_thread(ready)
            except threading.BrokenBarrierError:
                print(
                    f"tts-bench: client process {worker}: the other workers were not ready", file=sys.stderr
                )
        if idle:
            return start_at, LevelRun()
        delay = start_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif ready is None:
            print(f"tts-bench: client process {worker}: started {-delay:.2f} s late", file=sys.stderr)
        started = time.perf_counter()
        deadline = None if deadline_in_s is None else start_at + deadline_in_s
        if spec.mode == "closed":
            backoff = retry_after_backoff if getattr(args, "retry_after", False) else None
            run = await run_closed_loop(
                send, concurrency=slots, num_requests=len(indices), deadline=deadline, backoff=backoff
            )
        else:
            run = await run_open_loop(send, arrivals, deadline=deadline)
        # The loaders number requests locally; the records carry the level index already (send).
        return started, run
    finally:
        await aclose()


def _worker(
    args: argparse.Namespace,
    spec: LevelSpec,
    worker: int,
    processes: int,
    start_at: float,
    deadline_in_s: float | None,
    make_sender: SenderFactory,
    barrier: Any = None,
) -> tuple[float, LevelRun]:
    ready = None if barrier is None else barrier.wait
    return asyncio.run(_drive(args, spec, worker, processes, start_at, deadline_in_s, make_sender, ready))


def run_level(
    args: argparse.Namespace,
    spec: LevelSpec,
    processes: int,
    deadline: float | None,
    make_sender: SenderFactory,
) -> LevelRun:
    """Run one level over `processes` worker processes (spawned: no state shared with this one).
    `make_sender` must be a module-level function: the workers receive it by reference."""
    worker_args = argparse.Namespace(**{**vars(args), "processes": 1, "no_progress": True})
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        barrier = manager.Barrier(processes, timeout=BARRIER_TIMEOUT_S)
        start_at = time.perf_counter() + START_DELAY_S
        deadline_in_s = None if deadline is None else max(0.0, deadline - start_at)
        futures = [
            pool.submit(
                _worker, worker_args, spec, w, processes, start_at, deadline_in_s, make_sender, barrier
            )
            for w in range(processes)
        ]
        parts = [f.result() for f in futures]
    return merge(parts)
