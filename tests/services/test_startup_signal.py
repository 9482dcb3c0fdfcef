"""`run_service_main` in a real process: SIGTERM/SIGINT while the server is still starting (a
blocking model load in a thread) exits 0 at once, without a traceback; once it serves, a signal
drains as before. The launcher stops waiting for a starting service once it is asked to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from services.launcher import ServiceSpec, StartupInterrupted, free_port, start_service, wait_serving

ROOT = Path(__file__).resolve().parents[2]

# A service whose start-up blocks in a thread for `sys.argv[1]` seconds, like a model load.
SERVICE = textwrap.dedent(
    """
    import asyncio, sys, time
    from types import SimpleNamespace
    from qtts.serving.grpc_server import GrpcServiceHost, run_service_main

    class SlowStartServer:
        def __init__(self, config):
            self.host = GrpcServiceHost(service_names=["test.v1.Slow"], port=0, drain_seconds=30)
            self.host.add_shutdown_callback(lambda: print("SHUTDOWN CALLBACK", file=sys.stderr, flush=True))

        async def run(self):
            await self.host.start()
            print("LOADING", file=sys.stderr, flush=True)
            await asyncio.to_thread(time.sleep, float(sys.argv[1]))
            await self.host.set_serving()
            print("SERVING", file=sys.stderr, flush=True)
            await self.host.serve_until_signal()

    config = SimpleNamespace(log_level="INFO", gil_switch_interval_ms=0.25)
    sys.exit(run_service_main("slow", lambda argv: config, SlowStartServer, []))
    """
)


def start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def signal_at(proc: subprocess.Popen, marker: str, sig: signal.Signals, timeout_s: float = 120.0) -> str:
    """Send `sig` once `marker` shows on stderr; the stderr read until then."""
    seen = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stderr:
        seen.append(line)
        if line.strip() == marker:
            proc.send_signal(sig)
            return "".join(seen)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"{marker!r} never showed; stderr:\n{''.join(seen)}")


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    """(exit code, rest of stderr, seconds it took) of a process that was just signalled."""
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running {timeout_s} s after the signal; stderr:\n{err}") from None
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_exits_0_at_once_without_a_traceback(sig):
    proc = start(SERVICE, "120")
    before = signal_at(proc, "LOADING", sig)
    code, err, took = finish(proc, timeout_s=15.0)
    assert code == 0, before + err
    assert took < 10.0  # the 120 s "load" still running in its thread is not waited for
    assert f"received {sig.name} during start-up" in err
    assert "slow stopped during start-up" in err
    assert "SHUTDOWN CALLBACK" in err  # the service's own cleanup ran
    assert "Traceback" not in before + err and "KeyboardInterrupt" not in err


def test_a_signal_once_serving_still_drains_and_exits_0():
    proc = start(SERVICE, "0")
    before = signal_at(proc, "SERVING", signal.SIGTERM)
    code, err, _ = finish(proc, timeout_s=15.0)
    assert code == 0, before + err
    assert "received SIGTERM: draining" in err and "SHUTDOWN CALLBACK" in err
    assert "during start-up" not in err and "Traceback" not in before + err


def test_the_launcher_stops_waiting_for_a_starting_service_once_asked(tmp_path):
    # A process that never serves gRPC health: without the stop it would be waited for 60 s.
    spec = ServiceSpec(
        "still-loading", "http.server", ("0", "--bind", "127.0.0.1"), f"127.0.0.1:{free_port()}"
    )
    proc = start_service(spec, tmp_path)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StartupInterrupted, match="still-loading"):
            wait_serving(proc, timeout=60, stop=stop)
        assert time.monotonic() - t0 < 5.0
    finally:
        proc.stop(5.0)
