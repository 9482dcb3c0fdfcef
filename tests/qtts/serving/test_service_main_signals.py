"""`run_service_main` (qtts.serving.grpc_server) in a real process: SIGTERM/SIGINT while the server
is still starting (a blocking model load in a thread) exits 0 at once, without a traceback; once
it serves, a signal drains as before."""

from __future__ import annotations

import signal
import textwrap

import pytest

from tests.signal_process import finish, signal_at, start

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
