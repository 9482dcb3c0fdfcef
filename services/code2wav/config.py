"""code2wav configuration: a frozen dataclass from flags (env fallbacks `TTS_CODE2WAV_*`)."""

from __future__ import annotations

import argparse
import dataclasses
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.request.errors import InvalidArgument
from qtts.serving import service_config as common
from qtts.serving.service_config import check_connection_age, check_model_fields, check_server_fields
from qtts.serving.settings import ServiceSettings, group, setting
from qtts.serving.tls import TlsConfig
from qtts.streams.chunk_plan import DEFAULT_CHUNK_RAMP, DEFAULT_FIRST_CHUNK_FRAMES, ChunkPlan
from services.code2wav.credit import CreditPolicy
from services.code2wav.decode_cost import DecodeCost
from services.code2wav.model_loader import DTYPES

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DECODE_ENGINES = ("incremental", "slots")
DECODE_PRECISIONS = ("fp32", "tf32", "bf16")
# --max-batch when not given: the slots engine splits a large call into its captured shapes itself,
# so it takes every ready stream at once; the incremental decoder runs one batch per call.
DEFAULT_MAX_BATCH = {"incremental": 64, "slots": 256}


@dataclass(frozen=True)
class Code2WavConfig:
    """Everything code2wav needs at start-up; validated once by `validate()`."""

    host: str = common.host()
    port: int = common.port(50053)
    metrics_port: int = common.metrics_port(9103)
    # Empty = the tiny local default.
    model: str = setting("", "snapshot or speech_tokenizer folder, hub id, or (dummy) a config name")
    load_format: str = setting("auto", "how weights are loaded (dummy: random)", choices=LOAD_FORMATS)
    device: str = setting("cpu", "torch device (cpu, cuda, cuda:N)")
    dtype: str = setting("float32", choices=DTYPES)
    # "incremental": qtts.model.IncrementalDecoder (reference); "slots": qtts.decode_engine.SlotDecoder
    # (static slot pool, CUDA graphs per captured shape, fused SnakeBeta on a GPU).
    decode_engine: str = setting(
        "incremental",
        "incremental (reference) or slots (GPU engine: slot pool + CUDA graphs)",
        choices=DECODE_ENGINES,
    )
    # Empty = from --dtype.
    decode_precision: str = setting(
        "",
        "slots engine compute path: fp32, tf32 or bf16 (default: from --dtype)",
        choices=("", *DECODE_PRECISIONS),
    )
    max_states: int = setting(256, "live decoder states; one more stream is rejected with RESOURCE_EXHAUSTED")
    # None = by engine (DEFAULT_MAX_BATCH), see `batch_limit`.
    max_batch: int | None = setting(
        None,
        "streams decoded per step",
        shown=", ".join(f"{n} for {e}" for e, n in DEFAULT_MAX_BATCH.items()),
    )
    # 1,024 frames: about 28 ms of the H200's bf16 slot decoder (27 us a frame), the longest a first
    # chunk waits behind a call in flight; 64 steady 16-frame chunks a call.
    max_call_frames: int = setting(
        1024, "frames one decode call takes at most, earliest deadlines first (0 = only --max-batch)"
    )
    first_chunk_frames: int = setting(DEFAULT_FIRST_CHUNK_FRAMES, "frames in a stream's first chunk")
    chunk_frames_ramp: tuple[int, ...] = setting(
        DEFAULT_CHUNK_RAMP, "frames in the chunks after the first, comma-separated (the last repeats)"
    )
    # Credit: frames received but not decoded <= window; audio not acked <= max-ahead (see credit.py).
    credit_window_frames: int = setting(32, "frames a stream may send that are not decoded yet")
    max_ahead_frames: int = setting(100, "frames of audio a stream may be ahead of its acknowledgements")
    # About 5.3 MB each at full size (512: 2.7 GB). 64 missed 40% of a 200-voice pool's streams
    # on the H200 (685-744 misses a run, each a prefix decode in the one worker every decode call
    # waits behind: open_stream p50 ~0.5 s, chunks 1.3 s late at 768 streams).
    prefix_cache_entries: int = setting(
        512, "slots engine: decoder states after distinct ICL reference prefixes kept for reuse (0 = off)"
    )
    # cuDNN tries each convolution's algorithms once per captured shape at start-up (the slots
    # engine's graphs: 44 shapes); off, its heuristics choose. Measured on an H100 (2026-12-05,
    # benchmarks/code2wav_decode.py, bf16 channels-last graphs, 512 streams): off captured 20
    # shapes in 11.1 s against 43.7 s, and decoded at 689 us a frame against 19.2 (116x real time
    # against 4,172x). Keep it on; off is for start-up experiments only.
    cudnn_benchmark: bool = setting(
        True,
        "slots engine: let cuDNN time each convolution's algorithms at capture (off starts faster "
        "and decodes about 36x slower)",
    )
    max_prefix_frames: int = setting(2048, "longest reference prefix a stream may bring, frames")
    # Decode scheduling (see core.py): never within the safety margin of the nearest
    # playback deadline. Off by default: the wait re-checks every stream on each arrival, which at
    # hundreds of streams kept the event loop too busy to answer health checks.
    coalesce_max_ms: float = setting(
        0.0, "longest wait for more ready streams before a decode call (0 = decode at once)"
    )
    deadline_safety_ms: float = setting(
        100.0, "no waiting once a ready stream is this close to running out of audio"
    )
    decode_cost_ceiling: float = setting(
        1.5,
        "the decode cost a frame published to the talkers is at most this multiple of the start-up "
        "calibration's: a burst whose every call ran beside the talker's prefills otherwise reads as "
        "the decoder's own cost (0 = no bound)",
    )
    replica_name: str = setting("", "name reported in StreamDone (default: host name and port)")
    drain_seconds: float = common.drain_seconds(30.0)
    # Client connections are closed after this long so gateways/talkers re-resolve (0 = never);
    # streams on an aged connection get the grace (0 = drain_seconds) to finish.
    max_connection_age_s: float = common.max_connection_age_s()
    max_connection_age_grace_s: float = common.max_connection_age_grace_s()
    # sys.setswitchinterval for this process (see qtts/serving/service_config.py for what was measured).
    gil_switch_interval_ms: float = common.gil_switch_interval_ms()
    log_level: str = common.log_level()
    # Shared secret of the services (qtts/serving/internal_auth.py); empty: off.
    internal_token: str = common.internal_token(dials=False)
    # TLS / mutual TLS on the gRPC port (qtts/serving/tls.py); off by default.
    tls: TlsConfig = group(TlsConfig(), "tls", omit=("server_name",), what="gRPC between the services")

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
        check_model_fields(self)
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
        for name in ("prefix_cache_entries", "max_call_frames"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not DecodeCost.ceiling_ok(self.decode_cost_ceiling):
            raise InvalidArgument(
                f"--decode-cost-ceiling must be 0 (no bound) or >= 1, got {self.decode_cost_ceiling}"
            )
        if self.first_chunk_frames < 1 or not self.chunk_frames_ramp or min(self.chunk_frames_ramp) < 1:
            raise InvalidArgument("--first-chunk-frames and every --chunk-frames-ramp value must be >= 1")
        largest = self.chunk_plan.largest
        if largest > self.credit_policy.max_chunk_frames():
            raise InvalidArgument(
                f"the largest chunk ({largest} frames) must fit in --credit-window-frames and "
                f"--max-ahead-frames, or a stream could never fill it"
            )
        return self


SETTINGS = ServiceSettings(Code2WavConfig, "code2wav", "python -m services.code2wav", __doc__)


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def config_from_args(argv: Sequence[str] | None = None) -> Code2WavConfig:
    """Parse flags (falling back to env vars) into a validated `Code2WavConfig`."""
    config = SETTINGS.parse(argv)
    if not config.replica_name:
        config = dataclasses.replace(config, replica_name=f"{socket.gethostname()}:{config.port}")
    return config.validate()
