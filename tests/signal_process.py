"""A service run as a real child process and signalled at a marker line of its stderr, for the
start-up signal tests of several folders (`tests/qtts/serving/`, `tests/services/talker/`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(code: str, *args: str) -> subprocess.Popen:
    """`python -c code args...` from the repository root, stdout and stderr piped as text."""
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
