"""`tts_event_loop_lag_seconds`: a loop blocked by a callback shows its lag, an idle one does not,
and every service's gRPC host samples its loop while it runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from qtts.serving.grpc_server import GrpcServiceHost
from qtts.serving.loop_lag import STALL_DUMP_ENV, LoopLagMonitor, stall_dump_s_from_env
from qtts.serving.metrics import ServiceMetrics


def lag_count(registry: CollectorRegistry, service: str, le: str | None = None) -> float:
    if le is None:
        return registry.get_sample_value("tts_event_loop_lag_seconds_count", {"service": service}) or 0.0
    labels = {"service": service, "le": le}
    return registry.get_sample_value("tts_event_loop_lag_seconds_bucket", labels) or 0.0


async def test_a_blocked_loop_shows_its_lag_and_the_worst_since_the_last_scrape():
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, "svc", interval_s=0.01)

    def past_quarter_second() -> float:
        return lag_count(registry, "svc") - lag_count(registry, "svc", "0.25")

    def worst() -> float:
        return registry.get_sample_value("tts_event_loop_lag_max_seconds", {"service": "svc"})

    monitor.start()
    try:
        await asyncio.sleep(0.05)
        assert lag_count(registry, "svc") >= 1
        before = past_quarter_second()
        worst()  # a scrape: the worst starts again from here
        time.sleep(0.3)  # a callback that holds the loop for 300 ms
        await asyncio.sleep(0.05)
        assert past_quarter_second() >= before + 1
        assert 0.25 < worst()
        # A scrape takes the worst: the next one sees only samples taken after it.
        assert worst() == 0.0
    finally:
        await monitor.stop()
    stopped = lag_count(registry, "svc")
    await asyncio.sleep(0.05)
    assert lag_count(registry, "svc") == stopped  # no sampling after stop()


async def test_stop_and_start_again_and_a_bad_interval():
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, "svc", interval_s=0.01)
    await monitor.stop()  # never started: nothing to do
    monitor.start()
    monitor.start()  # running: one sampler, not two
    await asyncio.sleep(0.055)
    first = lag_count(registry, "svc")
    assert 1 <= first <= 6  # two samplers would take about 10
    await monitor.stop()
    monitor.start()
    await asyncio.sleep(0.03)
    await monitor.stop()
    assert lag_count(registry, "svc") > first
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagMonitor(CollectorRegistry(), "other", interval_s=0)


async def test_the_grpc_host_samples_its_loop_from_start_to_stop():
    metrics = ServiceMetrics(CollectorRegistry(), "test")
    metrics.loop_lag.interval_s = 0.01
    host = GrpcServiceHost(service_names=["test.Service"], metrics=metrics)
    assert lag_count(metrics.registry, "test") == 0
    await host.start()
    try:
        await asyncio.sleep(0.1)
        assert lag_count(metrics.registry, "test") >= 1
    finally:
        await host.stop(grace=0)
    stopped = lag_count(metrics.registry, "test")
    await asyncio.sleep(0.05)
    assert lag_count(metrics.registry, "test") == stopped


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a callback that holds the loop (and the GIL's turn) this long


async def test_a_stall_past_the_threshold_logs_the_loop_thread_s_stack(caplog):
    """With `stall_dump_s`, a loop held past it gets its thread's stack logged by the watchdog
    thread while the stall lasts (the blocking function in it), and a warning with the stall's
    length once the loop runs again; a lag under the threshold logs nothing, and the watchdog
    thread ends with the sampler."""
    monitor = LoopLagMonitor(CollectorRegistry(), "svc", interval_s=0.01, stall_dump_s=0.1)
    with caplog.at_level("WARNING", logger="qtts.serving.loop_lag"):
        monitor.start()
        try:
            await asyncio.sleep(0.05)
            _hold_the_loop(0.03)  # under the threshold
            await asyncio.sleep(0.05)
            assert monitor.stall_dumps == 0
            _hold_the_loop(0.4)
            await asyncio.sleep(0.05)
        finally:
            await monitor.stop()
    assert monitor.stall_dumps == 1
    messages = [r.getMessage() for r in caplog.records]
    (stack,) = [m for m in messages if "its thread's stack" in m]
    assert "(1 of at most 20)" in stack and "in _hold_the_loop" in stack
    assert any(m.startswith("the event loop stalled ") and "logged above" in m for m in messages)
    assert not [t for t in threading.enumerate() if t.name == "event-loop-stall-watchdog"]


def test_the_dump_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(STALL_DUMP_ENV, raising=False)
    assert LoopLagMonitor(CollectorRegistry(), "svc").stall_dump_s == 0.0
    monkeypatch.setenv(STALL_DUMP_ENV, "250")
    assert LoopLagMonitor(CollectorRegistry(), "svc").stall_dump_s == 0.25
    for bad in ("soon", "-5", "nan"):
        monkeypatch.setenv(STALL_DUMP_ENV, bad)
        with pytest.raises(ValueError, match=STALL_DUMP_ENV):
            stall_dump_s_from_env()
