"""Median timings for the GPU benchmark scripts: wall time with a device sync, or CUDA events
(wall time on a machine without CUDA)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_wall_s(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` from the host's view: work queued and finished (synchronised)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_event_s(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median seconds of the GPU work `fn()` queues, between two CUDA events."""
    if not torch.cuda.is_available():
        return median_wall_s(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_call_us(fn: Callable[[int], Any], calls: int, replays: int = 20) -> float:
    """Median microseconds per call of `fn(i)` for i in range(calls), all captured in one CUDA graph
    and replayed: what one call costs between other kernels of a replayed step (CUDA only)."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times)
