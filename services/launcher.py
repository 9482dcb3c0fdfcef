"""`python -m services.launcher` (what `make run` runs): start the whole stack on one machine.

Starts speaker_cache, the aligner (with `--aligner`), N code2wav replicas, the talker and the
gateway as separate processes (`python -m services.<name> ...`), waits until every one reports SERVING through grpc.health.v1,
prints where everything listens and a `curl` line that produces a wav, and on Ctrl-C/SIGTERM stops
them all (SIGTERM, then SIGKILL after a grace period). Logs go to `run/logs/<service>.log`.

Every service runs tethered to the process that started it (services/tether.py): a launcher that
dies, SIGKILL included, takes the services with it. A start on ports that something already holds
(an earlier stack still running) fails at once, naming the ports, instead of mistaking the old
stack's health answers for the new one's.

The functions here (`StackConfig`, `start_stack`, `Stack.stop`, `start_service`, ...) are also what
the end-to-end tests use to run the stack on free ports.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtts.request.errors import InvalidArgument
from qtts.resources import state_dir
from qtts.serving import probe
from qtts.serving.settings import ServiceSettings, SettingsError, group, setting
from qtts.serving.tls import TlsConfig
from qtts.tiny_model import ensure_tiny_snapshot
from services.supervisor import RestartPolicy, Supervisor

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOG_DIR = state_dir() / "run" / "logs"


class StartupError(RuntimeError):
    """A service did not become SERVING; the message names it and shows the tail of its log."""


class StartupInterrupted(StartupError):
    """A stop (Ctrl-C/SIGTERM) came before every service was SERVING."""


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PICKED_PORT = 20000
_MAX_PORT_SLICES = 16  # workers of a parallel test run whose count is not known
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _worker_slice(candidates: range, env) -> range:
    """The part of `candidates` that belongs to this pytest-xdist worker (`PYTEST_XDIST_WORKER`
    gwN of `PYTEST_XDIST_WORKER_COUNT`), so that two workers' stacks, which draw ports in separate
    processes, never pick the same one; all of it outside a parallel test run. The services a
    worker starts inherit its environment and so draw from its slice too."""
    worker = env.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return candidates
    try:
        count = max(int(env.get("PYTEST_XDIST_WORKER_COUNT", "")), 1)
    except ValueError:
        count = _MAX_PORT_SLICES
    index = int(worker[2:])
    count = max(count, index + 1)
    size = len(candidates) // count
    if size < 100:
        raise RuntimeError(f"{len(candidates)} ports cannot be split among {count} test workers")
    start = candidates.start + index * size
    return range(start, start + size)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now that this process has not handed out before (tests, stacks side by side).

    It is drawn outside the kernel's ephemeral range, so the outgoing connections of the processes
    around (a gRPC channel, a Redis client) cannot take it between this call and the service's bind,
    and it is never the same as an earlier answer, so two services of one stack never share a port.
    Under pytest-xdist each worker draws from a slice of its own (`_worker_slice`).
    """
    low, high = _ephemeral_range()
    if low - _LOWEST_PICKED_PORT >= 1000:
        candidates = range(_LOWEST_PICKED_PORT, low)
    elif 65535 - high >= 1000:
        candidates = range(high + 1, 65536)
    else:
        candidates = range(1024, 65536)
    candidates = _worker_slice(candidates, os.environ)
    rng = random.Random()
    with _handed_out_lock:
        for _ in range(1000):
            port = rng.choice(candidates)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free TCP port found on {host} in {candidates.start}-{candidates.stop - 1}")


def default_code2wav_ports(n: int, first: int = 50053, skip: int = 50054) -> tuple[int, ...]:
    """50053, 50055, 50056, ...: replicas after the first take the next ports, around speaker_cache."""
    ports, port = [], first
    while len(ports) < n:
        if port != skip:
            ports.append(port)
        port += 1
    return tuple(ports)


SERVICE_NAMES = ("gateway", "talker", "code2wav", "speaker_cache", "aligner")


@dataclass(frozen=True)
class StackConfig:
    """Where and how to run the stack. Metrics port 0 turns a service's metrics endpoint off."""

    model: str = ""  # empty: the tiny random Base snapshot in .tiny/ (built once)
    load_format: str = "auto"
    device: str = "cpu"
    # Devices of the code2wav replicas in turn (e.g. talker on cuda:0, replicas on cuda:1..3);
    # empty: `device`.
    code2wav_devices: tuple[str, ...] = ()
    dtype: str = "float32"
    redis_url: str = ""  # empty: speaker_cache keeps voices in memory
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    talker_port: int = 50052
    code2wav_ports: tuple[int, ...] = (50053,)
    speaker_cache_port: int = 50054
    gateway_metrics_port: int = 9100
    talker_metrics_port: int = 9102
    code2wav_metrics_ports: tuple[int, ...] = (9103,)
    speaker_cache_metrics_port: int = 9104
    # The optional aligner stage (word timestamps): 0 = not started, and the gateway refuses
    # word_timestamps. It serves the tiny random aligner unless extra_args["aligner"] name a --model.
    aligner_port: int = 0
    aligner_metrics_port: int = 0
    log_dir: Path = DEFAULT_LOG_DIR
    startup_timeout_s: float = 600.0
    drain_seconds: float = 5.0
    # Gateways in front of the one talker: the first on http_port / grpc_port / gateway_metrics_port,
    # gateway-i (i >= 1) on http_port + i, grpc_port + 10 + i and gateway_metrics_port + 10 + i, as
    # several gateway pods behind one Service would be.
    gateway_replicas: int = 1
    # Extra flags per service name ("gateway", "talker", "code2wav", "speaker_cache").
    extra_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # TLS between the services (qtts/serving/tls.py), the same files for every one; None: plaintext. The
    # gateway's public ports stay plaintext unless its extra_args give --public-tls-*.
    tls: TlsConfig | None = None
    # `make run`'s supervision (services/supervisor.py): restarts per service within 5 minutes
    # before a death stops the stack (0: the first death does).
    max_restarts: int = 5

    def validate(self) -> StackConfig:
        if not self.code2wav_ports:
            raise ValueError("at least one code2wav replica is needed")
        if len(self.code2wav_metrics_ports) != len(self.code2wav_ports):
            raise ValueError("one metrics port per code2wav replica is needed (0 = off)")
        if self.gateway_replicas < 1:
            raise ValueError("at least one gateway is needed")
        return self

    def gateway_ports(self, i: int) -> tuple[int, int, int]:
        """(HTTP, gRPC, metrics) port of gateway number `i` (0 = the first)."""
        if i == 0:
            return self.http_port, self.grpc_port, self.gateway_metrics_port
        metrics = self.gateway_metrics_port + 10 + i if self.gateway_metrics_port else 0
        return self.http_port + i, self.grpc_port + 10 + i, metrics

    def ports(self) -> dict[str, int]:
        """Every port the stack listens on, by what listens there (0 = off)."""
        ports = {
            "speaker_cache": self.speaker_cache_port,
            "speaker_cache metrics": self.speaker_cache_metrics_port,
            "talker": self.talker_port,
            "talker metrics": self.talker_metrics_port,
        }
        if self.aligner_port:
            ports.update({"aligner": self.aligner_port, "aligner metrics": self.aligner_metrics_port})
        for i, (port, metrics) in enumerate(
            zip(self.code2wav_ports, self.code2wav_metrics_ports, strict=True)
        ):
            ports[f"code2wav-{i}"], ports[f"code2wav-{i} metrics"] = port, metrics
        for i in range(self.gateway_replicas):
            name = "gateway" if i == 0 else f"gateway-{i}"
            http, grpc_port, metrics = self.gateway_ports(i)
            ports.update({f"{name} HTTP": http, f"{name} gRPC": grpc_port, f"{name} metrics": metrics})
        return ports

    @classmethod
    def on_free_ports(cls, code2wav_replicas: int = 1, **overrides) -> StackConfig:
        """A config whose every port is a currently free one (tests, several stacks side by side)."""
        ports = dict(
            http_port=free_port(),
            grpc_port=free_port(),
            talker_port=free_port(),
            code2wav_ports=tuple(free_port() for _ in range(code2wav_replicas)),
            speaker_cache_port=free_port(),
            gateway_metrics_port=free_port(),
            talker_metrics_port=free_port(),
            code2wav_metrics_ports=tuple(free_port() for _ in range(code2wav_replicas)),
            speaker_cache_metrics_port=free_port(),
        )
        ports.update(overrides)
        return cls(**ports).validate()


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


def ports_in_use(host: str, ports: dict[str, int]) -> dict[str, int]:
    """The entries of `ports` (name -> port, 0 = none) that a listener holds on `host` now."""
    taken = {}
    for name, port in ports.items():
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR as the servers bind: a port whose last connections linger in TIME_WAIT
            # is free for them, only a listener is in the way.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                taken[name] = port
    return taken


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


def _addr(host: str, port: int) -> str:
    return f"{host}:{port}"


def _tls_flags(cfg: StackConfig, client: bool = True) -> list[str]:
    """--tls-* for a service; `client`: it also dials others (--tls-server-name)."""
    return cfg.tls.flags(server_name=client) if cfg.tls is not None else []


def model_flags(cfg: StackConfig, model: str, device: str | None = None) -> tuple[str, ...]:
    return (
        "--model",
        model,
        "--load-format",
        cfg.load_format,
        "--device",
        device or cfg.device,
        "--dtype",
        cfg.dtype,
    )


def speaker_cache_spec(cfg: StackConfig) -> ServiceSpec:
    args = [
        "--host",
        cfg.host,
        "--port",
        str(cfg.speaker_cache_port),
        "--metrics-port",
        str(cfg.speaker_cache_metrics_port),
        "--redis-url",
        cfg.redis_url,
        "--drain-seconds",
        str(cfg.drain_seconds),
        *_tls_flags(cfg, client=False),
        *cfg.extra_args.get("speaker_cache", ()),
    ]
    return ServiceSpec(
        "speaker_cache",
        "services.speaker_cache",
        tuple(args),
        _addr(cfg.host, cfg.speaker_cache_port),
        cfg.speaker_cache_metrics_port,
        cfg.tls,
    )


def aligner_spec(cfg: StackConfig) -> ServiceSpec:
    args = [
        "--host",
        cfg.host,
        "--port",
        str(cfg.aligner_port),
        "--metrics-port",
        str(cfg.aligner_metrics_port),
        "--drain-seconds",
        str(cfg.drain_seconds),
        *_tls_flags(cfg, client=False),
        *cfg.extra_args.get("aligner", ()),
    ]
    return ServiceSpec(
        "aligner",
        "services.aligner",
        tuple(args),
        _addr(cfg.host, cfg.aligner_port),
        cfg.aligner_metrics_port,
        cfg.tls,
    )


def code2wav_specs(cfg: StackConfig, model: str) -> list[ServiceSpec]:
    specs = []
    for i, (port, mport) in enumerate(zip(cfg.code2wav_ports, cfg.code2wav_metrics_ports, strict=True)):
        name = f"code2wav-{i}"
        device = cfg.code2wav_devices[i % len(cfg.code2wav_devices)] if cfg.code2wav_devices else None
        args = [
            "--host",
            cfg.host,
            "--port",
            str(port),
            "--metrics-port",
            str(mport),
            "--replica-name",
            name,
            *model_flags(cfg, model, device),
            "--drain-seconds",
            str(cfg.drain_seconds),
            *_tls_flags(cfg, client=False),
            *cfg.extra_args.get("code2wav", ()),
        ]
        specs.append(
            ServiceSpec(name, "services.code2wav", tuple(args), _addr(cfg.host, port), mport, cfg.tls)
        )
    return specs


def talker_spec(
    cfg: StackConfig,
    model: str,
    *,
    name: str = "talker",
    port: int | None = None,
    metrics_port: int | None = None,
) -> ServiceSpec:
    port = cfg.talker_port if port is None else port
    mport = cfg.talker_metrics_port if metrics_port is None else metrics_port
    args = [
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--metrics-port",
        str(mport),
        *model_flags(cfg, model),
        "--code2wav",
        ",".join(_addr(cfg.host, p) for p in cfg.code2wav_ports),
        "--speaker-cache",
        _addr(cfg.host, cfg.speaker_cache_port),
        "--drain-seconds",
        str(cfg.drain_seconds),
        *_tls_flags(cfg),
        *cfg.extra_args.get("talker", ()),
    ]
    return ServiceSpec(name, "services.talker", tuple(args), _addr(cfg.host, port), mport, cfg.tls)


def gateway_spec(
    cfg: StackConfig,
    *,
    name: str = "gateway",
    talker_port: int | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    talker_metrics_port: int | None = None,
) -> ServiceSpec:
    """The gateway in front of the stack's talker, or of the one on `talker_port` (whose metrics
    port, for the playground's status strip, is then `talker_metrics_port` or unknown)."""
    grpc_port = cfg.grpc_port if grpc_port is None else grpc_port
    if talker_metrics_port is None and talker_port is None:
        talker_metrics_port = cfg.talker_metrics_port
    talker_metrics = (
        ["--talker-metrics-url", f"http://{cfg.host}:{talker_metrics_port}/metrics"]
        if talker_metrics_port
        else []
    )
    args = [
        "--host",
        cfg.host,
        "--http-port",
        str(cfg.http_port if http_port is None else http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(cfg.gateway_metrics_port if metrics_port is None else metrics_port),
        "--talker",
        _addr(cfg.host, cfg.talker_port if talker_port is None else talker_port),
        "--speaker-cache",
        _addr(cfg.host, cfg.speaker_cache_port),
        *(["--aligner", _addr(cfg.host, cfg.aligner_port)] if cfg.aligner_port else []),
        *talker_metrics,
        "--drain-seconds",
        str(cfg.drain_seconds),
        *_tls_flags(cfg),
        *cfg.extra_args.get("gateway", ()),
    ]
    return ServiceSpec(
        name,
        "services.gateway",
        tuple(args),
        _addr(cfg.host, grpc_port),
        cfg.gateway_metrics_port if metrics_port is None else metrics_port,
    )


class Stack:
    """The running services, in start order."""

    def __init__(self, config: StackConfig, model: str, processes: list[ServiceProcess]):
        self.config = config
        self.model = model
        self.processes = processes

    def __getitem__(self, name: str) -> ServiceProcess:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(name)

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.config.http_port}"

    @property
    def http_urls(self) -> list[str]:
        """Every gateway's HTTP base URL, the first one first."""
        return [
            f"http://{self.config.host}:{self.config.gateway_ports(i)[0]}"
            for i in range(self.config.gateway_replicas)
        ]

    @property
    def grpc_address(self) -> str:
        return _addr(self.config.host, self.config.grpc_port)

    def restart(self, name: str, grace: float = 10.0) -> ServiceProcess:
        """Stop one service and start it again with the same flags; waits until SERVING."""
        old = self[name]
        old.stop(grace)
        new = start_service(old.spec, self.config.log_dir, orphan_grace_s=self.config.drain_seconds + 5.0)
        self.processes[self.processes.index(old)] = new
        wait_serving(new, self.config.startup_timeout_s)
        return new

    def stop(self, grace: float = 10.0) -> dict[str, int]:
        """SIGTERM to every service (front first, so streams drain downstream), SIGKILL after grace."""
        return stop_services(self.processes, grace)


def stop_services(processes: Sequence[ServiceProcess], grace: float = 10.0) -> dict[str, int]:
    """SIGTERM all (last started first), SIGKILL what is left after `grace`; exit code per name."""
    for proc in reversed(processes):
        proc.terminate()
    deadline = time.monotonic() + grace
    return {
        proc.name: proc.wait_or_kill(max(0.1, deadline - time.monotonic())) for proc in reversed(processes)
    }


def stack_specs(config: StackConfig, model: str) -> list[ServiceSpec]:
    """Every service of the stack, in start order (speaker_cache, code2wav, talker, gateways)."""
    specs = [
        speaker_cache_spec(config),
        *([aligner_spec(config)] if config.aligner_port else []),
        *code2wav_specs(config, model),
        talker_spec(config, model),
        gateway_spec(config),
    ]
    for i in range(1, config.gateway_replicas):
        http, grpc_port, metrics = config.gateway_ports(i)
        specs.append(
            gateway_spec(
                config, name=f"gateway-{i}", http_port=http, grpc_port=grpc_port, metrics_port=metrics
            )
        )
    return specs


def start_stack(
    config: StackConfig, env: dict[str, str] | None = None, stop: threading.Event | None = None
) -> Stack:
    """Start every service and wait until all are SERVING; on failure stop them and raise StartupError
    (StartupInterrupted once `stop` is set: services still loading exit at once on SIGTERM)."""
    config.validate()
    taken = ports_in_use(config.host, config.ports())
    if taken:
        raise StartupError(
            "ports already in use on "
            + config.host
            + ": "
            + ", ".join(f"{port} ({name})" for name, port in taken.items())
            + "; is an earlier stack still running? Stop it, or start this one on other ports"
        )
    model = config.model or str(ensure_tiny_snapshot())
    specs = stack_specs(config, model)
    processes: list[ServiceProcess] = []
    grace = config.drain_seconds + 5.0
    try:
        for spec in specs:
            processes.append(start_service(spec, config.log_dir, env, orphan_grace_s=grace))
        for proc in processes:
            wait_serving(proc, config.startup_timeout_s, stop)
    except BaseException:
        stop_services(processes, grace=5.0)
        raise
    return Stack(config, model, processes)


def _tone_wav(seconds: float = 2.0, rate: int = 24000) -> bytes:
    """A short synthetic clip, so the demo voice needs no file from the user."""
    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * (180 + 60 * np.sin(2 * np.pi * 1.5 * t)) * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"{}")
        except ValueError:
            return exc.code, {"error": raw.decode(errors="replace")}


def demo_request(stack: Stack) -> dict:
    """A speech request body that works with the served variant (creates a demo voice for Base)."""
    _, models = _http_json(f"{stack.http_url}/v1/models")
    info = models["data"][0]
    # No length field: the tiny default model declares a default length (qtts.tiny_model), as it
    # never says end of speech by itself.
    body = {"model": info["id"], "input": "Hello from the Qwen3 TTS stack.", "response_format": "wav"}
    if info.get("model_type") == "custom_voice":
        _, voices = _http_json(f"{stack.http_url}/v1/audio/voices")
        presets = [v["name"] for v in voices["voices"] if v["kind"] == "preset"]
        body["voice"] = presets[0] if presets else "vivian"
    elif info.get("model_type") == "voice_design":
        body["instructions"] = "A warm, calm female voice."
    else:
        status, resp = _http_json(
            f"{stack.http_url}/v1/audio/voices",
            {
                "name": "demo",
                "audio": base64.b64encode(_tone_wav()).decode(),
                "x_vector_only_mode": True,
            },
        )
        if status not in (201, 409):  # 409: kept from an earlier run (Redis)
            raise ValueError(f"creating the demo voice failed ({status}): {resp.get('error', resp)}")
        body["voice"] = "demo"
    return body


def access_note(c: StackConfig) -> str:
    """Who can use the stack, said plainly: `make run` is open (no API keys, no internal token),
    which is safe on loopback only."""
    keys = any(a.startswith("--api-keys") for a in c.extra_args.get("gateway", ()))
    loopback = c.host in ("127.0.0.1", "localhost", "::1")
    if keys:
        return "API keys required (--api-keys-file); " + ("loopback only" if loopback else f"on {c.host}")
    if loopback:
        return "open: no API keys, no internal token, no TLS, on loopback (127.0.0.1) only"
    return (
        f"WARNING: open on {c.host}: no API keys, so anyone who reaches it can use it "
        "(--gateway-args '--api-keys-file FILE')"
    )


def describe(stack: Stack, body: dict) -> str:
    c = stack.config
    lines = [
        "Qwen3-TTS stack is up:",
        f"  gateway        HTTP {stack.http_url}   gRPC {stack.grpc_address} (tts.v1)",
        *[
            f"  {p.name:<14} HTTP {url}"
            for p, url in zip(
                [p for p in stack.processes if p.name.startswith("gateway-")],
                stack.http_urls[1:],
                strict=True,
            )
        ],
        f"  talker         {_addr(c.host, c.talker_port)}",
        *[f"  {p.name:<14} {p.spec.grpc_address}" for p in stack.processes if p.name.startswith("code2wav")],
        f"  speaker_cache  {_addr(c.host, c.speaker_cache_port)}"
        f" ({'redis ' + c.redis_url if c.redis_url else 'in-memory'})",
        *([f"  aligner        {_addr(c.host, c.aligner_port)} (word timestamps)"] if c.aligner_port else []),
        "  metrics        "
        + ", ".join(f"{p.name}:{p.spec.metrics_port}" for p in stack.processes if p.spec.metrics_port),
        f"  model          {stack.model}",
        f"  logs           {c.log_dir}/",
        f"  access         {access_note(c)}",
        "",
        f"Playground (type, pick a voice, hear it stream): {stack.http_url}/",
        "",
        "Try:",
        f"  curl -s {stack.http_url}/v1/audio/speech -H 'Content-Type: application/json' "
        f"-d '{json.dumps(body)}' -o hello.wav",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("float32", "bfloat16", "float16")


def _shell_words(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise SettingsError(f"must be flags as a shell would split them ({exc})") from None


def _extra_args(service: str) -> Any:
    return setting(
        (),
        f"extra flags for {service}, e.g. --talker-args '--engine graph --max-batch 256'",
        parse=_shell_words,
    )


@dataclass(frozen=True)
class LauncherSettings:
    """The launcher's flags (env fallbacks `TTS_LAUNCHER_*`); `stack_config()` makes the
    StackConfig they describe."""

    model: str = setting(
        "",
        "snapshot folder or hub id",
        env=("TTS_MODEL",),
        shown="a tiny random Base snapshot in .tiny/",
    )
    load_format: str = setting("auto", choices=LOAD_FORMATS)
    device: str = setting("cpu", "cpu or cuda[:N] for talker and code2wav")
    code2wav_devices: tuple[str, ...] = setting(
        (),
        "comma-separated devices the code2wav replicas take in turn, e.g. cuda:1,cuda:2",
        shown="`--device`",
    )
    dtype: str = setting("float32", choices=DTYPES)
    redis_url: str = setting("", "Redis for speaker_cache", env=("REDIS_URL",), shown="in-memory")
    code2wav_replicas: int = setting(1, "code2wav processes (on --code2wav-port and the next ports)")
    gateway_replicas: int = setting(1, "gateways in front of the talker (HTTP on --http-port, +1, +2, ...)")
    host: str = setting("127.0.0.1", "listen address of every service")
    http_port: int = setting(8000, "the gateway's HTTP port")
    grpc_port: int = setting(50051, "the gateway's gRPC port")
    talker_port: int = setting(50052, "the talker's gRPC port")
    code2wav_port: int = setting(50053, "the first replica's; more on the next ports")
    speaker_cache_port: int = setting(50054, "speaker_cache's gRPC port")
    aligner: bool = setting(
        False, "also start the aligner stage (the tiny random forced aligner) so word_timestamps work"
    )
    aligner_port: int = setting(50050, "the aligner's gRPC port (with --aligner)")
    metrics_port: int = setting(
        9100,
        "the gateway's metrics port; aligner +1, talker +2, code2wav +3 on, speaker_cache +4 (0: no metrics)",
    )
    log_dir: Path = setting(
        DEFAULT_LOG_DIR,
        "where each service logs (<service>.log)",
        parse=Path,
        shown="`run/logs` in the checkout or the state dir",
    )
    startup_timeout: float = setting(600.0, "seconds to wait for SERVING")
    max_restarts: int = setting(
        5,
        "a service that exits is started again, after a doubling back-off, up to this many times in "
        "5 minutes; then the stack stops (0: the first exit stops it)",
    )
    tls: TlsConfig = group(TlsConfig(), "tls", what="gRPC between the services (passed to each one)")
    gateway_args: tuple[str, ...] = _extra_args("gateway")
    talker_args: tuple[str, ...] = _extra_args("talker")
    code2wav_args: tuple[str, ...] = _extra_args("code2wav")
    speaker_cache_args: tuple[str, ...] = _extra_args("speaker_cache")
    aligner_args: tuple[str, ...] = _extra_args("aligner")

    def validate(self) -> LauncherSettings:
        """Raise `InvalidArgument` naming the flag for an unusable value."""
        if self.max_restarts < 0:
            raise InvalidArgument(f"--max-restarts must be >= 0, got {self.max_restarts}")
        for name in ("code2wav_replicas", "gateway_replicas"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        self.tls.validate()
        return self

    def stack_config(self) -> StackConfig:
        n = self.code2wav_replicas
        m = self.metrics_port
        metrics = (
            dict(
                gateway_metrics_port=m,
                talker_metrics_port=m + 2,
                code2wav_metrics_ports=default_code2wav_ports(n, m + 3, m + 4),
                speaker_cache_metrics_port=m + 4,
            )
            if m
            else dict(
                gateway_metrics_port=0,
                talker_metrics_port=0,
                code2wav_metrics_ports=(0,) * n,
                speaker_cache_metrics_port=0,
            )
        )
        return StackConfig(
            model=self.model,
            load_format=self.load_format,
            device=self.device,
            dtype=self.dtype,
            redis_url=self.redis_url,
            code2wav_devices=self.code2wav_devices,
            host=self.host,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            talker_port=self.talker_port,
            speaker_cache_port=self.speaker_cache_port,
            aligner_port=self.aligner_port if self.aligner else 0,
            aligner_metrics_port=m + 1 if self.aligner and m else 0,
            code2wav_ports=default_code2wav_ports(n, self.code2wav_port, self.speaker_cache_port),
            **metrics,
            log_dir=self.log_dir,
            startup_timeout_s=self.startup_timeout,
            gateway_replicas=self.gateway_replicas,
            extra_args={s: getattr(self, f"{s}_args") for s in SERVICE_NAMES},
            tls=self.tls if self.tls.enabled else None,
            max_restarts=self.max_restarts,
        ).validate()


SETTINGS = ServiceSettings(
    LauncherSettings, "launcher", "python -m services.launcher", __doc__.split("\n\n")[0]
)


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def config_from_args(argv: Sequence[str] | None = None) -> StackConfig:
    """The StackConfig the flags (env fallbacks `TTS_LAUNCHER_*`) describe; exits 2 with one line
    naming the setting on a bad value."""
    parser = build_parser()
    try:
        return SETTINGS.parse(argv, parser).validate().stack_config()
    except InvalidArgument as exc:
        parser.exit(2, f"{parser.prog}: error: {exc.message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting services (logs in {config.log_dir}/) ...", flush=True)
    try:
        stack = start_stack(config, stop=stop)
    except StartupInterrupted:
        print("stopped during start-up", flush=True)
        return 0
    except StartupError as exc:
        print(f"startup failed: {exc}", file=sys.stderr)
        return 1
    try:
        try:
            body = demo_request(stack)
        except (OSError, KeyError, ValueError) as exc:
            body = {"input": "Hello.", "voice": "VOICE", "response_format": "wav"}
            print(f"(could not prepare the demo request: {exc})", file=sys.stderr)
        print(describe(stack, body), flush=True)
        supervisor = Supervisor(stack, RestartPolicy(max_restarts=config.max_restarts))
        while not stop.wait(0.5):
            if supervisor.check() is not None:
                return 1
        print("stopping ...", flush=True)
        return 0
    finally:
        stack.stop(grace=config.drain_seconds + 5.0)


if __name__ == "__main__":
    sys.exit(main())
