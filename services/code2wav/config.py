"""code2wav configuration: a frozen dataclass from flags (env fallbacks `TTS_CODE2WAV_*`)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.chunk_plan import DEFAULT_CHUNK_RAMP, DEFAULT_FIRST_CHUNK_FRAMES, ChunkPlan
from qtts.errors import InvalidArgument
from qtts.service_config import (
    DEFAULT_GIL_SWITCH_INTERVAL_MS,
    DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
    DEFAULT_MAX_CONNECTION_AGE_S,
    add_connection_age_flags,
    add_server_flags,
    check_connection_age,
    check_server_fields,
    env_lookup,
)
from qtts.tls import TlsConfig, add_tls_flags, tls_from_args
from services.code2wav.credit import CreditPolicy
from services.code2wav.model_loader import DTYPES

_env = env_lookup("code2wav")


DECODE_ENGINES = ("incremental", "slots")
DECODE_PRECISIONS = ("fp32", "tf32", "bf16")
# --max-batch when not given: the slots engine splits a large call into its captured shapes itself,
# so it takes every ready stream at once; the incremental decoder runs one batch per call.
DEFAULT_MAX_BATCH = {"incremental": 64, "slots": 256}


@dataclass(frozen=True)
class Code2WavConfig:
    """Everything code2wav needs at start-up; validated once by `validate()`."""

    host: str = "127.0.0.1"
    port: int = 50053
    metrics_port: int = 9103
    # Snapshot folder, its speech_tokenizer/ folder or a hub id; empty = the tiny local default.
    model: str = ""
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    # "incremental": qtts.model.IncrementalDecoder (reference); "slots": qtts.decode_engine.SlotDecoder
    # (static slot pool, CUDA graphs per captured shape, fused SnakeBeta on a GPU).
    decode_engine: str = "incremental"
    # Compute path of the slots engine: fp32 (reference) | tf32 | bf16; empty = from --dtype.
    decode_precision: str = ""
    # Live decoder states; one more stream is rejected with RESOURCE_EXHAUSTED.
    max_states: int = 256
    # Streams decoded per engine step; None = by engine (DEFAULT_MAX_BATCH), see `batch_limit`.
    max_batch: int | None = None
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames_ramp: tuple[int, ...] = DEFAULT_CHUNK_RAMP
    # Credit: frames received but not decoded <= window; audio not acked <= max-ahead (see credit.py).
    credit_window_frames: int = 32
    max_ahead_frames: int = 100
    # slots engine: decoder states after distinct reference prefixes kept for reuse (LRU, 0 = off);
    # about 5 MB each at full size.
    prefix_cache_entries: int = 64
    max_prefix_frames: int = 2048
    # Decode scheduling (see decode_worker.py): wait up to this long for more ready streams before a
    # call when no stream is starting (0 = never wait), and never within the safety margin of the
    # nearest playback deadline. Off by default: the wait re-checks every stream on each arrival,
    # which at hundreds of streams kept the event loop so busy on the H200 that health checks
    # timed out.
    coalesce_max_ms: float = 0.0
    deadline_safety_ms: float = 100.0
    replica_name: str = ""
    drain_seconds: float = 30.0
    # Client connections are closed after this long so gateways/talkers re-resolve (0 = never);
    # streams on an aged connection get the grace (0 = drain_seconds) to finish.
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S
    max_connection_age_grace_s: float = DEFAULT_MAX_CONNECTION_AGE_GRACE_S
    # sys.setswitchinterval for this process (see qtts/service_config.py for what was measured).
    gil_switch_interval_ms: float = DEFAULT_GIL_SWITCH_INTERVAL_MS
    log_level: str = "INFO"
    # Shared secret of the services (qtts/internal_auth.py); empty: off.
    internal_token: str = ""
    # TLS / mutual TLS on the gRPC port (qtts/tls.py); off by default.
    tls: TlsConfig = TlsConfig()

    @property
    def batch_limit(self) -> int:
        """--max-batch, or the decode engine's default when it was not given."""
        if self.max_batch is not None:
            return self.max_batch
        return DEFAULT_MAX_BATCH.get(self.decode_engine, DEFAULT_MAX_BATCH["incremental"])

    @property
    def chunk_plan(self) -> ChunkPlan:
        return ChunkPlan(self.first_chunk_frames, self.chunk_frames_ramp)

    @property
    def credit_policy(self) -> CreditPolicy:
        return CreditPolicy(self.credit_window_frames, self.max_ahead_frames)

    def validate(self) -> Code2WavConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self)
        check_connection_age(self)
        self.tls.validate()
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise InvalidArgument(
                f"--load-format must be auto, safetensors or dummy, got {self.load_format!r}"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.decode_engine not in DECODE_ENGINES:
            raise InvalidArgument(
                f"--decode-engine must be one of {', '.join(DECODE_ENGINES)}, got {self.decode_engine!r}"
            )
        if self.decode_precision not in ("", *DECODE_PRECISIONS):
            raise InvalidArgument(
                f"--decode-precision must be one of {', '.join(DECODE_PRECISIONS)}, got {self.decode_precision!r}"
            )
        if self.max_batch is not None and self.max_batch < 1:
            raise InvalidArgument(f"--max-batch must be >= 1, got {self.max_batch}")
        for name in (
            "max_states",
            "credit_window_frames",
            "max_ahead_frames",
            "max_prefix_frames",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("coalesce_max_ms", "deadline_safety_ms"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.prefix_cache_entries < 0:
            raise InvalidArgument(f"--prefix-cache-entries must be >= 0, got {self.prefix_cache_entries}")
        if self.first_chunk_frames < 1 or not self.chunk_frames_ramp or min(self.chunk_frames_ramp) < 1:
            raise InvalidArgument("--first-chunk-frames and every --chunk-frames-ramp value must be >= 1")
        largest = self.chunk_plan.largest
        if largest > self.credit_policy.max_chunk_frames():
            raise InvalidArgument(
                f"the largest chunk ({largest} frames) must fit in --credit-window-frames and "
                f"--max-ahead-frames, or a stream could never fill it"
            )
        return self


def _ramp(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidArgument(f"--chunk-frames-ramp must be comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = Code2WavConfig()
    p = argparse.ArgumentParser(prog="python -m services.code2wav", description=__doc__)
    add_server_flags(p, _env, d)
    p.add_argument(
        "--internal-token",
        default=_env("INTERNAL_TOKEN", d.internal_token),
        help="shared secret of the services (qtts/internal_auth.py): required from callers; "
        "prefer the env var to the flag (default: off)",
    )
    add_tls_flags(p, _env, server_name=False)
    add_connection_age_flags(p, _env, d)
    p.add_argument(
        "--model",
        default=_env("MODEL", d.model),
        help="snapshot or speech_tokenizer folder, hub id, or (dummy) a config name",
    )
    p.add_argument("--load-format", default=_env("LOAD_FORMAT", d.load_format))
    p.add_argument("--device", default=_env("DEVICE", d.device))
    p.add_argument("--dtype", default=_env("DTYPE", d.dtype))
    p.add_argument(
        "--decode-engine",
        choices=DECODE_ENGINES,
        default=_env("DECODE_ENGINE", d.decode_engine),
        help="incremental (reference) or slots (GPU engine: slot pool + CUDA graphs)",
    )
    p.add_argument(
        "--decode-precision",
        default=_env("DECODE_PRECISION", d.decode_precision),
        help="slots engine compute path: fp32, tf32 or bf16 (default: from --dtype)",
    )
    p.add_argument("--max-states", type=int, default=int(_env("MAX_STATES", str(d.max_states))))
    max_batch = _env("MAX_BATCH", None)
    p.add_argument(
        "--max-batch",
        type=int,
        default=int(max_batch) if max_batch else None,
        help="streams decoded per step (default by engine: "
        + ", ".join(f"{n} for {e}" for e, n in DEFAULT_MAX_BATCH.items())
        + ")",
    )
    p.add_argument(
        "--first-chunk-frames", type=int, default=int(_env("FIRST_CHUNK_FRAMES", str(d.first_chunk_frames)))
    )
    p.add_argument(
        "--chunk-frames-ramp", default=_env("CHUNK_FRAMES_RAMP", ",".join(map(str, d.chunk_frames_ramp)))
    )
    p.add_argument(
        "--credit-window-frames",
        type=int,
        default=int(_env("CREDIT_WINDOW_FRAMES", str(d.credit_window_frames))),
    )
    p.add_argument(
        "--prefix-cache-entries",
        type=int,
        default=int(_env("PREFIX_CACHE_ENTRIES", str(d.prefix_cache_entries))),
        help="slots engine: decoder states after distinct ICL reference prefixes kept for reuse (0 = off)",
    )
    p.add_argument(
        "--max-ahead-frames", type=int, default=int(_env("MAX_AHEAD_FRAMES", str(d.max_ahead_frames)))
    )
    p.add_argument(
        "--max-prefix-frames", type=int, default=int(_env("MAX_PREFIX_FRAMES", str(d.max_prefix_frames)))
    )
    p.add_argument(
        "--coalesce-max-ms",
        type=float,
        default=float(_env("COALESCE_MAX_MS", str(d.coalesce_max_ms))),
        help="longest wait for more ready streams before a decode call (0 = decode at once)",
    )
    p.add_argument(
        "--deadline-safety-ms",
        type=float,
        default=float(_env("DEADLINE_SAFETY_MS", str(d.deadline_safety_ms))),
        help="no waiting once a ready stream is this close to running out of audio",
    )
    p.add_argument(
        "--replica-name",
        default=_env("REPLICA_NAME", d.replica_name),
        help="name reported in StreamDone (default: host name and port)",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> Code2WavConfig:
    """Parse flags (falling back to env vars) into a validated `Code2WavConfig`."""
    ns = build_parser().parse_args(argv)
    return Code2WavConfig(
        host=ns.host,
        port=ns.port,
        metrics_port=ns.metrics_port,
        model=ns.model,
        load_format=ns.load_format,
        device=ns.device,
        dtype=ns.dtype,
        decode_engine=ns.decode_engine,
        decode_precision=ns.decode_precision,
        max_states=ns.max_states,
        max_batch=ns.max_batch,
        first_chunk_frames=ns.first_chunk_frames,
        chunk_frames_ramp=_ramp(ns.chunk_frames_ramp),
        credit_window_frames=ns.credit_window_frames,
        max_ahead_frames=ns.max_ahead_frames,
        prefix_cache_entries=ns.prefix_cache_entries,
        max_prefix_frames=ns.max_prefix_frames,
        coalesce_max_ms=ns.coalesce_max_ms,
        deadline_safety_ms=ns.deadline_safety_ms,
        replica_name=ns.replica_name or f"{socket.gethostname()}:{ns.port}",
        drain_seconds=ns.drain_seconds,
        max_connection_age_s=ns.max_connection_age_s,
        max_connection_age_grace_s=ns.max_connection_age_grace_s,
        gil_switch_interval_ms=ns.gil_switch_interval_ms,
        log_level=ns.log_level,
        internal_token=ns.internal_token,
        tls=tls_from_args(ns),
    ).validate()
