"""One load level driven by several client processes.

A single Python client reading hundreds of streamed responses can fall behind them: its own event
loop lag then reads as gaps in the audio. With `--processes N` every level's requests are split
over N worker processes: request i of the level goes to worker i mod N (so every level still walks
the same prompt, seed and length sequence), closed-loop slots are split as evenly as possible, and
open-loop arrival i keeps its time. All workers start together at one moment of the host's
monotonic clock (`time.perf_counter` is CLOCK_MONOTONIC on Linux, shared by every process), and
their records are merged back into one level with start times on one time base.

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
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from benchmarks.loadgen import LevelRun, retry_after_backoff, run_closed_loop, run_open_loop
from benchmarks.metrics import RequestRecord
from benchmarks.transport import warm_or_log

START_DELAY_S = 2.0  # room for every worker to import, load the reference clip and warm its client


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
) -> tuple[float, LevelRun]:
    send_global, aclose, warm = make_sender(args, spec)  # the worker's own client
    try:
        indices, slots, arrivals = shard(spec, worker, processes)
        if not indices or (spec.mode == "closed" and not slots):
            return start_at, LevelRun()

        async def send(local: int) -> RequestRecord:
            record = await send_global(indices[local])
            return record

        # Within the wait for the common start, never past it: a late worker starts cold.
        remaining = start_at - time.perf_counter()
        if remaining > 0:
            await warm_or_log(warm, remaining, f"client process {worker}")
        else:
            print(f"tts-bench: client process {worker}: no time left to warm the client", file=sys.stderr)
        delay = start_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
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
) -> tuple[float, LevelRun]:
    return asyncio.run(_drive(args, spec, worker, processes, start_at, deadline_in_s, make_sender))


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
    start_at = time.perf_counter() + START_DELAY_S
    deadline_in_s = None if deadline is None else max(0.0, deadline - start_at)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        futures = [
            pool.submit(_worker, worker_args, spec, w, processes, start_at, deadline_in_s, make_sender)
            for w in range(processes)
        ]
        parts = [f.result() for f in futures]
    return merge(parts)
