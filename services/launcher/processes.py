"""One service as a process of its own: start it tethered (services/tether.py), wait until it is
SERVING, stop it (SIGTERM, then SIGKILL after a grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qtts.serving import probe
from qtts.serving.tls import TlsConfig

ROOT = Path(__file__).resolve().parents[2]


class StartupError(RuntimeError):
    """A service did not become SERVING; the message names it and shows the tail of its log."""


class StartupInterrupted(StartupError):
    """A stop (Ctrl-C/SIGTERM) came before every service was SERVING."""


@dataclass(frozen=True)
class ServiceSpec:
    """One service process to run: its name, module, flags and the gRPC port to health-check."""

    name: str
    module: str
    args: tuple[str, ...]
    grpc_address: str
    metrics_port: int = 0
    # How the health check reaches `grpc_address` (None: plaintext).
    tls: TlsConfig | None = None


class ServiceProcess:
    """A running service process with its log file."""

    def __init__(self, spec: ServiceSpec, popen: subprocess.Popen, log_path: Path):
        self.spec = spec
        self.popen = popen
        self.log_path = log_path

    @property
    def name(self) -> str:
        return self.spec.name

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def wait_or_kill(self, grace: float) -> int:
        try:
            return self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code."""
        self.terminate()
        return self.wait_or_kill(grace)


def start_service(
    spec: ServiceSpec, log_dir: Path, env: dict[str, str] | None = None, *, orphan_grace_s: float = 15.0
) -> ServiceProcess:
    """Start `python -m <module> <args>` from the repository root, output into `<log_dir>/<name>.log`.

    The service is tethered to this process (services/tether.py): when it dies the service drains
    and exits, and is ended after `orphan_grace_s` if the drain takes longer."""
    tether = [
        "-m",
        "services.tether",
        "--parent",
        str(os.getpid()),
        "--grace",
        str(orphan_grace_s),
        # The kernel's parent-death signal follows the forking thread: only the main thread's
        # children may use it (a worker thread that ends would take its services along).
        *(["--pdeathsig"] if threading.current_thread() is threading.main_thread() else []),
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    with open(log_path, "ab") as log:
        log.write(
            f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {spec.module} {' '.join(spec.args)}\n".encode()
        )
        log.flush()
        popen = subprocess.Popen(
            [sys.executable, *tether, spec.module, *spec.args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            # Own process group: a Ctrl-C in the terminal reaches the launcher only, which then
            # drains the services in order.
            start_new_session=True,
        )
    return ServiceProcess(spec, popen, log_path)


def health_status(address: str, timeout: float = 1.0, tls: TlsConfig | None = None) -> str:
    """The overall grpc.health.v1 status name of a server, or "UNREACHABLE"."""
    return probe.health_status(address, tls, timeout=timeout)


def wait_serving(proc: ServiceProcess, timeout: float, stop: threading.Event | None = None) -> None:
    """Block until `proc` reports SERVING; StartupError naming it (with its log tail) otherwise,
    StartupInterrupted as soon as `stop` is set."""
    deadline = time.monotonic() + timeout
    status = "UNREACHABLE"
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise StartupInterrupted(f"stopped while waiting for {proc.name} to be SERVING")
        if not proc.alive():
            raise StartupError(
                f"{proc.name} exited with code {proc.popen.returncode} before it was SERVING; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        status = health_status(proc.spec.grpc_address, tls=proc.spec.tls)
        if status == "SERVING":
            return
        time.sleep(0.2)
    raise StartupError(
        f"{proc.name} was not SERVING after {timeout:.0f} s (last health: {status}); "
        f"log {proc.log_path}:\n{proc.log_tail()}"
    )


def stop_services(processes: Sequence[ServiceProcess], grace: float = 10.0) -> dict[str, int]:
    """SIGTERM all (last started first), SIGKILL what is left after `grace`; exit code per name."""
    for proc in reversed(processes):
        proc.terminate()
    deadline = time.monotonic() + grace
    return {
        proc.name: proc.wait_or_kill(max(0.1, deadline - time.monotonic())) for proc in reversed(processes)
    }
