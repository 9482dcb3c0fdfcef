"""End-to-end fixtures: a real redis-server and the services as separate processes on free ports.

One stack serves the tiny Base model with two code2wav replicas (started once per session);
CustomVoice and VoiceDesign get their own talker + gateway pairs that share that stack's code2wav
replicas and speaker_cache, started only by the tests that need them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from e2e_helpers import VariantGateway, running_stack, tiny_snapshot, tiny_stack_config

from services.launcher import (
    Stack,
    StartupError,
    free_port,
    gateway_spec,
    start_service,
    stop_services,
    talker_spec,
    wait_serving,
)


def _wait_redis(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("redis-server did not answer PING")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        # A skip would pass the suite without the voice store it proves: fail, everywhere.
        pytest.fail("redis-server is not installed (make test installs it: .ci/system-deps)")
    data_dir = tmp_path_factory.mktemp("redis")
    port = free_port()
    log = open(data_dir / "redis.log", "wb")
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data_dir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_redis(port, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def snapshot_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="session")
def stack(redis_url, snapshot_root, tmp_path_factory) -> Stack:
    """Base model stack: speaker_cache (Redis), 2 code2wav replicas, talker, gateway."""
    config = tiny_stack_config(
        snapshot_root, tmp_path_factory.mktemp("logs"), code2wav_replicas=2, redis_url=redis_url
    )
    with running_stack(config) as started:
        yield started


@pytest.fixture(scope="module")
def variant_gateways(stack, snapshot_root) -> dict[str, VariantGateway]:
    """CustomVoice and VoiceDesign talkers (+ a gateway each) on the shared code2wav/speaker_cache."""
    cfg = stack.config
    procs, out = [], {}
    try:
        for kind in ("custom_voice", "voice_design"):
            model = str(tiny_snapshot(snapshot_root, kind))
            talker_port, talker_metrics = free_port(), free_port()
            http_port, grpc_port = free_port(), free_port()
            t = start_service(
                talker_spec(cfg, model, name=f"talker-{kind}", port=talker_port, metrics_port=talker_metrics),
                cfg.log_dir,
            )
            procs.append(t)
            g = start_service(
                gateway_spec(
                    cfg,
                    name=f"gateway-{kind}",
                    talker_port=talker_port,
                    http_port=http_port,
                    grpc_port=grpc_port,
                    metrics_port=0,
                    talker_metrics_port=talker_metrics,
                ),
                cfg.log_dir,
            )
            procs.append(g)
            out[kind] = VariantGateway(
                f"http://{cfg.host}:{http_port}", f"{cfg.host}:{grpc_port}", talker_metrics
            )
        for proc in procs:
            wait_serving(proc, cfg.startup_timeout_s)
    except StartupError as exc:
        stop_services(procs, 5.0)
        pytest.fail(f"variant talker did not start: {exc}")
    yield out
    exit_codes = stop_services(procs, 20.0)
    # SIGTERM drains and exits cleanly; a SIGKILL after the grace period shows up as -9.
    assert exit_codes == {p.name: 0 for p in procs}, exit_codes
