"""aligner configuration: a frozen dataclass from flags (env fallbacks `TTS_ALIGNER_*`).

The stage is optional: the gateway only offers word timestamps when `--aligner-address` points at
one. Without `--model` it serves the tiny random aligner (tests, `make run`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.request.errors import InvalidArgument
from qtts.serving import service_config as common
from qtts.serving.service_config import (
    DTYPES,
    LOAD_FORMATS,
    check_connection_age,
    check_model_fields,
    check_server_fields,
)
from qtts.serving.settings import ServiceSettings, group, setting
from qtts.serving.tls import TlsConfig


@dataclass(frozen=True)
class AlignerConfig:
    """Everything the aligner needs at start-up; validated once by `validate()`."""

    host: str = common.host()
    port: int = common.port(50055)
    metrics_port: int = common.metrics_port(9105)
    # Empty = the tiny local default.
    model: str = setting(
        "", "forced-aligner snapshot folder, hub id, or (dummy) a config name (qwen3-forcedaligner-0.6b)"
    )
    load_format: str = setting("auto", "how weights are loaded (dummy: random)", choices=LOAD_FORMATS)
    device: str = setting("cpu", "torch device (cpu, cuda, cuda:N)")
    dtype: str = setting("float32", choices=DTYPES)
    max_batch: int = setting(32, "requests aligned in one forward pass at most")
    gather_ms: float = setting(
        50.0,
        "hold a forward pass until its oldest request has waited this long or --max-batch are "
        "queued, so the requests share it (0 = run at once)",
    )
    gpu_share: float = setting(
        0.5,
        "most of the time the forward passes may take: after a pass of t s the next waits "
        "t * (1 / share - 1), so a burst of segments ending together does not hold the GPU the "
        "talker and code2wav share (1 = back to back)",
    )
    share_max_wait_ms: float = setting(
        3000.0,
        "--gpu-share gives way once the oldest queued request has waited this long: the passes then "
        "run back to back until the queue is younger (timestamps ever later are worse than a busier GPU)",
    )
    cuda_graphs: bool = setting(
        True, "on a GPU, capture each (batch, length) bucket's forward pass as a CUDA graph on first use"
    )
    max_graphs: int = setting(48, "CUDA graphs kept at most; buckets past them run eagerly")
    graph_max_length: int = setting(1024, "longest prompt (positions) a CUDA graph is captured for")
    graph_warmup_s: str = setting(
        "2,5,10",
        "on a GPU, before SERVING: capture the graphs of speech clips this long (seconds, a comma "
        "list) at every batch size up to --max-batch; empty: capture on first use only",
    )
    max_audio_s: float = setting(300.0, "longest audio one request may bring, seconds")
    max_text_chars: int = setting(4096, "longest transcript one request may bring, characters")
    drain_seconds: float = common.drain_seconds(10.0)
    max_connection_age_s: float = common.max_connection_age_s()
    max_connection_age_grace_s: float = common.max_connection_age_grace_s()
    gil_switch_interval_ms: float = common.gil_switch_interval_ms()
    log_level: str = common.log_level()
    internal_token: str = common.internal_token(dials=False)
    tls: TlsConfig = group(TlsConfig(), "tls", omit=("server_name",), what="gRPC between the services")

    def validate(self) -> AlignerConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self)
        check_connection_age(self)
        self.tls.validate()
        check_model_fields(self)
        self.warmup_seconds()
        if self.max_graphs < 0:
            raise InvalidArgument(f"--max-graphs must be >= 0, got {self.max_graphs}")
        if not 0 < self.gpu_share <= 1:
            raise InvalidArgument(f"--gpu-share must be in (0, 1], got {self.gpu_share}")
        if self.share_max_wait_ms < 0:
            raise InvalidArgument(f"--share-max-wait-ms must be >= 0, got {self.share_max_wait_ms}")
        if not 0 <= self.gather_ms <= 1000:
            raise InvalidArgument(f"--gather-ms must be in [0, 1000], got {self.gather_ms}")
        for name in ("max_batch", "max_text_chars", "graph_max_length"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.max_audio_s <= 400:
            # 5000 timestamp classes of 80 ms: the aligner cannot place a word past 400 s.
            raise InvalidArgument(f"--max-audio-s must be in (0, 400], got {self.max_audio_s}")
        return self

    def warmup_seconds(self) -> list[float]:
        """--graph-warmup-s as numbers; raises `InvalidArgument` for a bad list."""
        try:
            out = [float(x) for x in self.graph_warmup_s.split(",") if x.strip()]
        except ValueError:
            out = [-1.0]
        if any(not 0 < s <= self.max_audio_s for s in out):
            raise InvalidArgument(
                f"--graph-warmup-s must be a comma list of seconds in (0, --max-audio-s], got {self.graph_warmup_s!r}"
            )
        return out


SETTINGS = ServiceSettings(AlignerConfig, "aligner", "python -m services.aligner", __doc__)


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def config_from_args(argv: Sequence[str] | None = None) -> AlignerConfig:
    """Parse flags (falling back to env vars) into a validated `AlignerConfig`."""
    return SETTINGS.parse(argv).validate()
