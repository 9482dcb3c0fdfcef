"""`python -m services.launcher` (what `make run` runs) leaves no orphans: a launcher killed with
SIGKILL takes its four services with it within seconds, and frees their ports. A start on ports an
earlier stack still holds fails at once, naming them, instead of reporting that stack as up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_helpers import tiny_snapshot

from services.launcher import (
    ROOT,
    ServiceSpec,
    StackConfig,
    free_port,
    ports_in_use,
    speaker_cache_spec,
    start_service,
    wait_serving,
)

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...: comm may hold spaces, so split after its ")".
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for whoever adopted it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _launcher_flags(ports: dict[str, int], model: Path, log_dir: Path) -> list[str]:
    return [
        "--model", str(model),
        "--http-port", str(ports["http"]),
        "--grpc-port", str(ports["grpc"]),
        "--talker-port", str(ports["talker"]),
        "--code2wav-port", str(ports["code2wav"]),
        "--speaker-cache-port", str(ports["speaker_cache"]),
        "--metrics-port", "0",
        "--log-dir", str(log_dir),
        "--startup-timeout", "120",
    ]  # fmt: skip


@pytest.fixture
def ports() -> dict[str, int]:
    return {name: free_port() for name in ("http", "grpc", "talker", "code2wav", "speaker_cache")}


@pytest.fixture(scope="module")
def model(snapshot_root) -> Path:
    return tiny_snapshot(snapshot_root, "base")


def _start_launcher(flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.launcher", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # a signal for the launcher only, as from another terminal
    )


def test_a_sigkilled_launcher_leaves_no_service_running(ports, model, tmp_path):
    launcher = _start_launcher(_launcher_flags(ports, model, tmp_path))
    services: list[int] = []
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if "stack is up" in line:
                break
        assert "stack is up" in "".join(lines), "".join(lines)
        services = _children(launcher.pid)
        assert len(services) == 4, (services, "".join(lines))
        assert ports_in_use("127.0.0.1", ports) == ports  # all listening

        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        killed_at = time.monotonic()
        deadline = killed_at + 10
        while time.monotonic() < deadline and not all(_gone(p) for p in services):
            time.sleep(0.05)
        took = time.monotonic() - killed_at
        assert all(_gone(p) for p in services), [p for p in services if not _gone(p)]
        assert took < 5, f"services took {took:.1f} s to go"
        assert ports_in_use("127.0.0.1", ports) == {}
    finally:
        for pid in [launcher.pid, *services]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.stdout.close()


def test_a_start_on_a_stale_stacks_port_fails_and_names_it(ports, model, tmp_path):
    # An earlier stack's speaker_cache, still up on the port the new stack wants.
    cfg = StackConfig(
        host="127.0.0.1", speaker_cache_port=ports["speaker_cache"], speaker_cache_metrics_port=0
    )
    stale = start_service(speaker_cache_spec(cfg), tmp_path)
    try:
        wait_serving(stale, 60)
        # A second server on that port fails to bind (no SO_REUSEPORT sharing).
        spec = speaker_cache_spec(cfg)
        twin = start_service(ServiceSpec("twin", spec.module, spec.args, spec.grpc_address), tmp_path)
        assert twin.popen.wait(30) != 0
        started = time.monotonic()
        launcher = _start_launcher(_launcher_flags(ports, model, tmp_path))
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 1, out
        assert time.monotonic() - started < 20
        assert f"{ports['speaker_cache']} (speaker_cache)" in out and "earlier stack" in out, out
        assert "stack is up" not in out
        assert stale.alive()
    finally:
        stale.stop(5)
