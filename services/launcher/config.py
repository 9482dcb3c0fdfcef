"""`StackConfig`: where and how the launcher runs the stack, and the ports it listens on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qtts.resources import state_dir
from qtts.serving.tls import TlsConfig
from services.launcher.ports import free_port

DEFAULT_LOG_DIR = state_dir() / "run" / "logs"


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

    def address(self, port: int) -> str:
        """`host:port` of a service of the stack."""
        return f"{self.host}:{port}"

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
