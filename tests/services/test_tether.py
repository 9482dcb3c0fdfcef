"""services/tether.py: a tethered service ends when its parent dies, by the kernel's parent-death
signal or, without it, by its watchdog; one that ignores SIGTERM is ended after the grace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from services.launcher import ROOT, ServiceSpec, free_port, start_service

# A middle process (the "launcher") that starts one tethered child, prints its pid and waits.
MIDDLE = textwrap.dedent(
    """
    import subprocess, sys, os, time
    flags = sys.argv[1:]
    child = subprocess.Popen(
        [sys.executable, "-m", "services.tether", "--parent", str(os.getpid()), *flags]
    )
    print(child.pid, flush=True)
    time.sleep(120)
    """
)

STUBBORN = textwrap.dedent(
    """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _orphan_lifetime(*flags: str, env: dict[str, str] | None = None) -> float:
    """Seconds a tethered child outlives its SIGKILLed parent."""
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    child = int(middle.stdout.readline())
    time.sleep(1.0)  # the child is up and has armed its watchdog
    assert not _gone(child)
    middle.kill()
    middle.wait()
    middle.stdout.close()
    killed = time.monotonic()
    try:
        while not _gone(child) and time.monotonic() - killed < 15:
            time.sleep(0.02)
        return time.monotonic() - killed
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


HTTP_SERVER = ["http.server", "--bind", "127.0.0.1", "0"]


def test_the_parent_death_signal_ends_the_child_at_once():
    assert _orphan_lifetime("--pdeathsig", *HTTP_SERVER) < 0.5


def test_without_the_signal_the_watchdog_ends_the_child():
    assert _orphan_lifetime(*HTTP_SERVER) < 2.0


def test_a_child_that_ignores_sigterm_is_ended_after_the_grace(tmp_path):
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    lifetime = _orphan_lifetime("--pdeathsig", "--grace", "1", "stubborn", env={"PYTHONPATH": str(tmp_path)})
    assert 0.9 < lifetime < 3.0


def test_a_service_started_off_the_main_thread_outlives_that_thread(tmp_path):
    """The parent-death signal follows the forking thread: a worker thread that ends must not take
    its services along, so the launcher only asks for it on the main thread."""
    spec = ServiceSpec("http", "http.server", ("--bind", "127.0.0.1", str(free_port())), "")
    started = []
    worker = threading.Thread(target=lambda: started.append(start_service(spec, tmp_path)))
    worker.start()
    worker.join()
    (proc,) = started
    try:
        time.sleep(1.0)
        assert proc.alive(), proc.log_tail()
        assert "--pdeathsig" not in proc.popen.args
    finally:
        proc.stop(5)
