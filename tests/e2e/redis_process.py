"""A real redis-server for fault tests: persistence as deployed (AOF), stopped and restarted at will.

The server runs with the flags of the Valkey StatefulSet in deploy/k8s/base/redis.yaml (append-only
file, fsync policy, eviction), so a voice surviving a restart here is what the manifests promise.
A machine without redis-server fails the test: these tests are the proof, a skip would hide it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from services.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "k8s" / "base" / "redis.yaml"


def deployed_redis_args() -> list[str]:
    """The redis container's args of the kustomize base (its StatefulSet), less `--requirepass`:
    its value there is `$(REDIS_PASSWORD)`, which the kubelet expands from the Secret, and these
    tests' clients connect without a password (tests/deploy checks the password wiring)."""
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc and doc.get("kind") == "StatefulSet":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            args = [str(a) for a in container["args"]]
            if "--requirepass" in args:
                i = args.index("--requirepass")
                del args[i : i + 2]
            return args
    raise AssertionError(f"no StatefulSet in {MANIFEST}")


class RedisProcess:
    """redis-server on a fixed port and data folder; `stop()` then `start()` is a restart."""

    def __init__(self, data_dir: Path, port: int | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail(
                "redis-server is not installed (make test installs it: .ci/system-deps); the fault tests need it"
            )
        self.exe = exe
        self.data_dir = data_dir
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        args = [
            self.exe,
            *deployed_redis_args(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
        ]
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    # While loading the AOF the server answers -LOADING: not up yet.
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> None:
        """SIGTERM is what a pod restart sends (Redis flushes its AOF); SIGKILL is a crash."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def aof_files(self) -> list[Path]:
        return sorted(p for p in self.data_dir.rglob("*.aof*") if p.is_file())
