"""The launcher's flags (`LauncherSettings`, env fallbacks `TTS_LAUNCHER_*`) and the `StackConfig`
they describe."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtts.request.errors import InvalidArgument
from qtts.serving.settings import ServiceSettings, SettingsError, group, setting
from qtts.serving.tls import TlsConfig
from services.launcher.config import DEFAULT_LOG_DIR, SERVICE_NAMES, StackConfig, default_code2wav_ports

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
    LauncherSettings,
    "launcher",
    "python -m services.launcher",
    "`python -m services.launcher` (what `make run` runs): start the whole stack on one machine.",
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
