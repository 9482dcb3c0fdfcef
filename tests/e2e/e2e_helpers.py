"""Helpers of the end-to-end tests: requests, reference clips, metrics scraping, polling."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import time
import urllib.request
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launcher import (
    ServiceProcess,
    Stack,
    StackConfig,
    StartupError,
    free_port,
    gateway_spec,
    start_service,
    start_stack,
    stop_services,
    wait_serving,
)

FRAME = 1920
FRAME_BYTES = FRAME * 2


def tiny_snapshot(root: Path, model_type: str = "base") -> Path:
    """The tiny random-weight snapshot of `model_type` under `root`, built on first use (the
    modules of one session share it)."""
    from qtts.tiny_model import build_tiny_snapshot

    path = root / f"tiny-{model_type.replace('_', '-')}"
    if not (path / "config.json").exists():
        build_tiny_snapshot(path, model_type)
    return path


def tiny_stack_config(snapshot_root: Path, log_dir: Path, **overrides: Any) -> StackConfig:
    """A stack on free ports over the tiny Base model, one code2wav replica; `overrides` are
    `StackConfig` fields."""
    fields: dict[str, Any] = {
        "code2wav_replicas": 1,
        "model": str(tiny_snapshot(snapshot_root, "base")),
        "startup_timeout_s": 300.0,
        "drain_seconds": 2.0,
        "log_dir": log_dir,
    }
    return StackConfig.on_free_ports(**{**fields, **overrides})


@contextlib.contextmanager
def running_stack(config: StackConfig) -> Iterator[Stack]:
    """The stack of `config`, started (the test fails, loudly, if it does not) and stopped after."""
    try:
        started = start_stack(config)
    except StartupError as exc:
        pytest.fail(f"stack did not start: {exc}")
    try:
        yield started
    finally:
        started.stop(grace=10.0)


@dataclass(frozen=True)
class VariantGateway:
    http_url: str
    grpc_address: str
    talker_metrics_port: int


def reference_wav(seconds: float = 1.5, rate: int = 16000) -> bytes:
    """A short voiced-sounding clip (harmonics with vibrato), as a 16 kHz wav file."""
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 20 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    return buf.getvalue()


REF_WAV = reference_wav()
REF_B64 = base64.b64encode(REF_WAV).decode()
REF_TEXT = "This is the reference clip."


def wav_frames(data: bytes) -> int:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getnframes()


def scrape(port: int) -> dict[str, float]:
    """Prometheus samples of a service as {name{labels}: value} (labels sorted, empty = no braces)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def poll(condition: Callable[[], bool], timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


@dataclass(frozen=True)
class ExtraGateway:
    """A gateway of its own beside the shared stack (same talker and speaker_cache)."""

    url: str
    http_port: int
    grpc_address: str
    proc: ServiceProcess


@contextlib.contextmanager
def extra_gateway(cfg: StackConfig, name: str, flags: tuple[str, ...] = ()) -> Iterator[ExtraGateway]:
    """Start a gateway named `name` with the stack's flags plus `flags` on free ports, wait until it
    is SERVING and its /health says ready (30 s at most), and stop it cleanly afterwards."""
    http_port, grpc_port = free_port(), free_port()
    spec = gateway_spec(cfg, name=name, http_port=http_port, grpc_port=grpc_port, metrics_port=0)
    spec = dataclasses.replace(spec, args=(*spec.args, *flags))
    proc = start_service(spec, cfg.log_dir)
    try:
        wait_serving(proc, cfg.startup_timeout_s)
        url = f"http://{cfg.host}:{http_port}"
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, f"{name} did not get ready"
            time.sleep(0.2)
        yield ExtraGateway(url, http_port, f"{cfg.host}:{grpc_port}", proc)
    finally:
        assert stop_services([proc], 20.0) == {proc.name: 0}
