"""The launcher (services/launcher/) stops waiting for a starting service once it is asked to
stop. (`run_service_main`'s own start-up signals: tests/qtts/serving/test_service_main_signals.py;
the talker's: tests/services/talker/test_talker_startup_signal.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from services.launcher import ServiceSpec, StartupInterrupted, free_port, start_service, wait_serving


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
