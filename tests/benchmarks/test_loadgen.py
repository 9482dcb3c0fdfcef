"""Closed-loop and open-loop drivers with a fake `send`, and the seeded Poisson schedule."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from benchmarks.loadgen import poisson_arrivals, run_closed_loop, run_open_loop
from benchmarks.metrics import build_record
from benchmarks.report import level_result


class FakeSend:
    """Records which indices were sent and how many were in flight at once."""

    def __init__(self, delay_s: float = 0.01, hang: bool = False):
        self.delay_s = delay_s
        self.hang = hang
        self.sent: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, index: int):
        start = time.perf_counter()
        self.sent.append(index)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        return build_record(
            index=index,
            prompt_index=0,
            start_s=start,
            chunk_times_s=[0.001],
            chunk_bytes=[4800],
            e2e_s=time.perf_counter() - start,
            ok=True,
            status="200",
        )


def test_poisson_rate_and_exponential_interarrivals():
    rate = 8.0
    arrivals = poisson_arrivals(rate, count=2000, seed=1234)
    assert len(arrivals) == 2000
    gaps = np.diff([0.0, *arrivals])
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.05)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential: std == mean
    # Memorylessness, coarsely: about e^-1 of the gaps exceed the mean.
    assert np.mean(gaps > 1.0 / rate) == pytest.approx(np.exp(-1), abs=0.04)


def test_poisson_is_seeded_and_duration_bounded():
    assert poisson_arrivals(3.0, count=50, seed=7) == poisson_arrivals(3.0, count=50, seed=7)
    assert poisson_arrivals(3.0, count=50, seed=7) != poisson_arrivals(3.0, count=50, seed=8)
    arrivals = poisson_arrivals(20.0, duration_s=100.0, seed=3)
    assert max(arrivals) < 100.0
    assert len(arrivals) == pytest.approx(2000, rel=0.1)
    assert len(poisson_arrivals(20.0, count=10, duration_s=100.0, seed=3)) == 10
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, count=5)
    with pytest.raises(ValueError):
        poisson_arrivals(1.0)


async def test_closed_loop_holds_concurrency_and_sends_each_index_once():
    send = FakeSend()
    seen = []
    run = await run_closed_loop(send, concurrency=4, num_requests=13, on_done=seen.append)
    assert sorted(send.sent) == list(range(13))
    assert send.max_in_flight == 4
    assert [r.index for r in run.records] == list(range(13))
    assert len(seen) == 13
    assert all(r.start_s >= 0 for r in run.records)  # rebased to the level start
    assert run.wall_s > 0 and run.aborted == 0 and not run.hit_deadline


async def test_closed_loop_with_more_workers_than_requests():
    send = FakeSend()
    run = await run_closed_loop(send, concurrency=64, num_requests=3)
    assert len(run.records) == 3 and send.max_in_flight == 3


async def test_closed_loop_deadline_aborts_in_flight_requests():
    send = FakeSend(hang=True)
    run = await run_closed_loop(send, concurrency=3, num_requests=10, deadline=time.perf_counter() + 0.05)
    assert run.hit_deadline
    assert run.aborted == 3
    assert run.records == []
    assert send.in_flight == 0  # cancelled, not leaked


async def test_open_loop_sends_in_arrival_order_without_waiting_for_completions():
    send = FakeSend(delay_s=0.2)
    run = await run_open_loop(send, [0.0, 0.0, 0.0, 0.001, 0.002])
    assert send.sent == [0, 1, 2, 3, 4]
    assert send.max_in_flight == 5  # an open loop never waits for a response before the next send
    assert len(run.records) == 5


async def test_open_loop_deadline_stops_dispatch():
    send = FakeSend(hang=True)
    run = await run_open_loop(send, [0.0, 60.0], deadline=time.perf_counter() + 0.05)
    assert send.sent == [0]
    assert run.hit_deadline and run.aborted == 1 and run.records == []


async def test_errors_in_send_are_not_swallowed():
    async def broken(index: int):
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):
        await run_closed_loop(broken, concurrency=2, num_requests=2)


async def test_closed_loop_backoff_waits_the_refusals_retry_after():
    """With `backoff=retry_after_backoff` a refused worker waits the record's Retry-After before
    its next request; an admitted one goes on at once."""
    from benchmarks.loadgen import retry_after_backoff

    async def send(index: int):
        refused = index == 0
        return build_record(
            index=index,
            prompt_index=0,
            start_s=time.perf_counter(),
            chunk_times_s=[] if refused else [0.001],
            chunk_bytes=[] if refused else [4800],
            e2e_s=0.001,
            ok=not refused,
            status="429" if refused else "200",
            extra={"retry_after_s": 0.3} if refused else None,
        )

    run = await run_closed_loop(send, concurrency=1, num_requests=3, backoff=retry_after_backoff)
    starts = [r.start_s for r in run.records]
    assert starts[1] - starts[0] >= 0.3 and starts[2] - starts[1] < 0.2
    assert retry_after_backoff(run.records[1]) == 0.0
    run.records[0].extra.clear()
    assert retry_after_backoff(run.records[0]) == 1.0  # no hint: one second


def test_a_level_records_how_late_the_client_s_own_event_loop_woke():
    """A send that blocks the event loop for 100 ms (as parsing hundreds of streams does) shows in
    the level's loop-lag samples and their summary; an idle loop's samples stay small."""

    async def blocking_send(index: int):
        time.sleep(0.1)  # holds the loop: the sampler wakes about 100 ms late
        await asyncio.sleep(0.05)
        return build_record(
            index=index,
            prompt_index=0,
            start_s=time.perf_counter(),
            chunk_times_s=[0.001],
            chunk_bytes=[4800],
            e2e_s=0.15,
            ok=True,
            status="200",
        )

    busy = asyncio.run(run_closed_loop(blocking_send, concurrency=1, num_requests=3))
    assert busy.loop_lag_s and max(busy.loop_lag_s) >= 0.05
    quiet = asyncio.run(run_closed_loop(FakeSend(delay_s=0.05), concurrency=1, num_requests=3))
    assert quiet.loop_lag_s and max(quiet.loop_lag_s) < 0.05
    summary = level_result("closed", busy, concurrency=1)["client_loop_lag_ms"]
    assert summary["max"] >= 50 and summary["samples"] == len(busy.loop_lag_s)
    assert summary["p50"] <= summary["p99"] <= summary["max"]
