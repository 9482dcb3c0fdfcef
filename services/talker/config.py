"""talker configuration: a frozen dataclass from flags (env fallbacks `TTS_TALKER_*`), validated once."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.errors import InvalidArgument
from qtts.service_config import (
    DEFAULT_MAX_CONNECTION_AGE_GRACE_S,
    DEFAULT_MAX_CONNECTION_AGE_S,
    add_connection_age_flags,
    add_server_flags,
    check_connection_age,
    check_server_fields,
    env_lookup,
)
from qtts.testing import DEFAULT_TINY_SNAPSHOT
from qtts.tls import TlsConfig, add_tls_flags, tls_from_args

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("float32", "bfloat16", "float16")
# Where `make run` / a bare `python -m services.talker` builds its tiny random Base snapshot
# (the same folder code2wav uses by default).


_env = env_lookup("talker")


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


ENGINES = ("eager", "graph")
# qtts.engine.model_runner.KERNEL_CHOICES, copied so that parsing flags does not import torch
# (a test checks they are equal).
DECODE_KERNELS = SAMPLE_KERNELS = ("auto", "triton", "torch")


TALKER_GIL_SWITCH_INTERVAL_MS = 1.0


@dataclass(frozen=True)
class TalkerConfig:
    """Everything the talker needs at start-up; validated once by `validate()`."""

    host: str = "127.0.0.1"
    port: int = 50052
    metrics_port: int = 9102
    # Empty: build (once) and serve a tiny random Base snapshot at DEFAULT_TINY_SNAPSHOT.
    model: str = ""
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    code2wav: tuple[str, ...] = ("127.0.0.1:50053",)
    # Empty: no speaker_cache (voice prompts are computed locally; named voices are unavailable).
    speaker_cache: str = "127.0.0.1:50054"
    speaker_cache_timeout_s: float = 2.0
    max_batch: int = 64
    # "eager": qtts.model.EagerGenerator; "graph": qtts.engine.GraphEngine (static KV slots, CUDA
    # graphs per batch bucket on a GPU; the same code runs eagerly on a CPU).
    engine: str = "eager"
    # GPU-local KV cache of voice-only prompt prefixes (graph engine), in MiB; 0 = off.
    prefix_cache_mb: int = 1024
    # Graph engine: KV positions per slot (prompt + frames), the attention-span bucket step of the
    # captured frame steps (fewer buckets: faster start-up, more KV read per step), and the widths
    # of captured prefill graphs (empty: eager prefill).
    max_len: int = 1024
    context_step: int = 128
    prefill_buckets: tuple[int, ...] = ()
    # Graph engine: prompt positions prefilled per step (bounds a running stream's stall; must keep
    # up with arrivals), and the frame step's decode layers: "auto" (fused Triton kernels on CUDA),
    # "triton" or "torch" (the PyTorch ops, a fallback).
    max_prefill_tokens: int = 2048
    decode_kernels: str = "auto"
    # Sampling of the 16 codebooks: "auto" (one Triton kernel per codebook on CUDA), "triton", or
    # "torch" (the PyTorch reference; same semantics, more kernels).
    sample_kernel: str = "auto"
    # Playback-deadline scheduling (services/talker/scheduler.py): a step runs once a stream's
    # listener would have less than the urgent lead buffered after its next chunk, and a stream
    # whose generated audio leads its listener by the max lead pauses.
    urgent_lead_ms: float = 2000.0
    max_lead_ms: float = 4000.0
    # New prompts wait up to this long to be prefilled together while streams play (0: at once);
    # due streams that are not short of audio step at most this often (0: at once).
    prefill_coalesce_ms: float = 120.0
    min_step_interval_ms: float = 0.0
    # Admission from measured capacity (services/talker/admission.py): a request starts only while a
    # step of every running stream is predicted to take at most this share of a frame (0 = no
    # limit), and waits at most the first-audio budget before it is refused (0 = no budget).
    admission_max_duty: float = 0.6
    # ... and while the predicted steady load (frame steps plus the prefills of the streams that
    # replace those ending) keeps the engine thread busy at most this fraction of the time.
    admission_max_load: float = 0.8
    first_audio_budget_ms: float = 3000.0
    # Requests waiting for a generator slot beyond max_batch; more are rejected (RESOURCE_EXHAUSTED).
    max_queue: int = 256
    # Frames a stream may generate ahead of the credit code2wav granted (its send buffer bound).
    credit_window_frames: int = 8
    ring_vnodes: int = 160
    health_interval_s: float = 2.0
    # A stream with frames waiting on its replica that hears nothing from it (no credit, no audio)
    # for this long fails, and the replica leaves the ring (0 = off): a hung decoder process can
    # still answer keepalive pings and health checks.
    code2wav_stall_timeout_s: float = 30.0
    drain_seconds: float = 30.0
    # Client connections are closed after this long so gateways/talkers re-resolve (0 = never);
    # streams on an aged connection get the grace (0 = drain_seconds) to finish.
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S
    max_connection_age_grace_s: float = DEFAULT_MAX_CONNECTION_AGE_GRACE_S
    # sys.setswitchinterval for this process: 1 ms, not CPython's 5 ms, so the engine thread gets
    # the GIL back sooner after each CUDA call while the event loop runs (H200 stack at 8b638fb,
    # c=256/512: 100%/93% of streams gap-free against 94%/89% at 5 ms).
    gil_switch_interval_ms: float = TALKER_GIL_SWITCH_INTERVAL_MS
    log_level: str = "INFO"
    # Shared secret of the services (qtts/internal_auth.py); empty: off.
    internal_token: str = ""
    # TLS / mutual TLS on the gRPC port and to code2wav and speaker_cache (qtts/tls.py); off by default.
    tls: TlsConfig = TlsConfig()

    @property
    def model_path(self) -> str:
        return self.model or str(DEFAULT_TINY_SNAPSHOT)

    def validate(self) -> TalkerConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self)
        check_connection_age(self)
        self.tls.validate()
        if self.load_format not in LOAD_FORMATS:
            raise InvalidArgument(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.code2wav:
            raise InvalidArgument("--code2wav needs at least one host:port address")
        for addr in self.code2wav:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise InvalidArgument(f"--code2wav address {addr!r} is not host:port")
        if self.engine not in ENGINES:
            raise InvalidArgument(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.prefix_cache_mb < 0:
            raise InvalidArgument(f"--prefix-cache-mb must be >= 0, got {self.prefix_cache_mb}")
        if self.max_prefill_tokens < 1:
            raise InvalidArgument(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.decode_kernels not in DECODE_KERNELS:
            raise InvalidArgument(
                f"--decode-kernels must be one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernels!r}"
            )
        if self.sample_kernel not in SAMPLE_KERNELS:
            raise InvalidArgument(
                f"--sample-kernel must be one of {', '.join(SAMPLE_KERNELS)}, got {self.sample_kernel!r}"
            )
        if self.max_batch < 1:
            raise InvalidArgument(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_len < 2 or self.context_step < 1 or any(w < 1 for w in self.prefill_buckets):
            raise InvalidArgument(
                f"--max-len must be >= 2, --context-step >= 1 and --prefill-buckets positive, got "
                f"{self.max_len}, {self.context_step}, {list(self.prefill_buckets)}"
            )
        if self.prefill_coalesce_ms < 0 or self.min_step_interval_ms < 0:
            raise InvalidArgument("--prefill-coalesce-ms and --min-step-interval-ms must be >= 0")
        if not 0 <= self.urgent_lead_ms <= self.max_lead_ms:
            raise InvalidArgument(
                f"--urgent-lead-ms and --max-lead-ms must satisfy 0 <= urgent <= max, got "
                f"{self.urgent_lead_ms:g} and {self.max_lead_ms:g}"
            )
        if self.admission_max_duty < 0 or self.admission_max_load < 0 or self.first_audio_budget_ms < 0:
            raise InvalidArgument(
                "--admission-max-duty, --admission-max-load and --first-audio-budget-ms must be >= 0"
            )
        if self.max_queue < 0:
            raise InvalidArgument(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.credit_window_frames < 1:
            raise InvalidArgument(f"--credit-window-frames must be >= 1, got {self.credit_window_frames}")
        if self.ring_vnodes < 1:
            raise InvalidArgument(f"--ring-vnodes must be >= 1, got {self.ring_vnodes}")
        if self.drain_seconds < 0 or self.speaker_cache_timeout_s <= 0 or self.health_interval_s <= 0:
            raise InvalidArgument(
                "--drain-seconds must be >= 0; --speaker-cache-timeout-s and --health-interval-s > 0"
            )
        if self.code2wav_stall_timeout_s < 0:
            raise InvalidArgument(
                f"--code2wav-stall-timeout-s must be >= 0 (0 = off), got {self.code2wav_stall_timeout_s}"
            )
        return self


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise InvalidArgument(f"{flag} must be comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = TalkerConfig()
    p = argparse.ArgumentParser(prog="python -m services.talker", description=__doc__)
    add_server_flags(p, _env, d)
    p.add_argument(
        "--internal-token",
        default=_env("INTERNAL_TOKEN", d.internal_token),
        help="shared secret of the services (qtts/internal_auth.py): sent on calls to the other "
        "services and required from callers; prefer the env var to the flag (default: off)",
    )
    add_tls_flags(p, _env)
    add_connection_age_flags(p, _env, d)
    p.add_argument(
        "--model",
        default=_env("MODEL", d.model),
        help=f"snapshot folder, hub id, or a shipped config name with --load-format dummy "
        f"(default: a tiny random Base snapshot in {DEFAULT_TINY_SNAPSHOT})",
    )
    p.add_argument("--load-format", default=_env("LOAD_FORMAT", d.load_format), choices=LOAD_FORMATS)
    p.add_argument("--device", default=_env("DEVICE", d.device))
    p.add_argument("--dtype", default=_env("DTYPE", d.dtype), choices=DTYPES)
    p.add_argument(
        "--code2wav",
        default=_env("CODE2WAV", ",".join(d.code2wav)),
        help="comma-separated code2wav replica addresses (host:port)",
    )
    p.add_argument(
        "--speaker-cache",
        default=_env("SPEAKER_CACHE", d.speaker_cache),
        help="speaker_cache address (empty = none)",
    )
    p.add_argument(
        "--speaker-cache-timeout-s",
        type=float,
        default=float(_env("SPEAKER_CACHE_TIMEOUT_S", str(d.speaker_cache_timeout_s))),
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=int(_env("MAX_BATCH", str(d.max_batch))),
        help="streams generated together in one batched step",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=_env("ENGINE", d.engine),
        help="generation engine: eager (reference) or graph (CUDA-graph frame step)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=int(_env("PREFIX_CACHE_MB", str(d.prefix_cache_mb))),
        help="graph engine: KV cache of voice-only prompt prefixes, MiB (0 = off)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=int(_env("MAX_LEN", str(d.max_len))),
        help="graph engine: KV positions per slot (prompt + generated frames)",
    )
    p.add_argument(
        "--context-step",
        type=int,
        default=int(_env("CONTEXT_STEP", str(d.context_step))),
        help="graph engine: attention-span bucket step of the captured frame steps",
    )
    p.add_argument(
        "--prefill-buckets",
        default=_env("PREFILL_BUCKETS", ",".join(map(str, d.prefill_buckets))),
        help="graph engine on CUDA: widths of captured prefill graphs, e.g. 64,128,256,512 (empty: eager)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=int(_env("MAX_PREFILL_TOKENS", str(d.max_prefill_tokens))),
        help="graph engine: prompt positions prefilled per step",
    )
    p.add_argument(
        "--decode-kernels",
        default=_env("DECODE_KERNELS", d.decode_kernels),
        choices=DECODE_KERNELS,
        help="graph engine: frame-step decode layers: auto (fused Triton kernels on CUDA), triton or torch",
    )
    p.add_argument(
        "--sample-kernel",
        default=_env("SAMPLE_KERNEL", d.sample_kernel),
        choices=SAMPLE_KERNELS,
        help="graph engine: codebook sampling: auto (one Triton kernel per codebook on CUDA), triton or torch",
    )
    p.add_argument(
        "--urgent-lead-ms",
        type=float,
        default=float(_env("URGENT_LEAD_MS", str(d.urgent_lead_ms))),
        help="a step runs once a stream's listener would have less than this buffered after its next chunk",
    )
    p.add_argument(
        "--max-lead-ms",
        type=float,
        default=float(_env("MAX_LEAD_MS", str(d.max_lead_ms))),
        help="a stream this far ahead of its listener pauses, leaving the steps to others",
    )
    p.add_argument(
        "--prefill-coalesce-ms",
        type=float,
        default=float(_env("PREFILL_COALESCE_MS", str(d.prefill_coalesce_ms))),
        help="while streams play, new prompts wait up to this long (or for 8 of them) to be "
        "prefilled in one step (0 = each at once)",
    )
    p.add_argument(
        "--min-step-interval-ms",
        type=float,
        default=float(_env("MIN_STEP_INTERVAL_MS", str(d.min_step_interval_ms))),
        help="streams that are due but not short of audio step at most this often, so more of them "
        "join each step (0 = at once; first chunks and short streams always step at once)",
    )
    p.add_argument(
        "--admission-max-duty",
        type=float,
        default=float(_env("ADMISSION_MAX_DUTY", str(d.admission_max_duty))),
        help="start a request only while a step of every running stream is predicted to take at "
        "most this share of a frame (0 = no limit)",
    )
    p.add_argument(
        "--admission-max-load",
        type=float,
        default=float(_env("ADMISSION_MAX_LOAD", str(d.admission_max_load))),
        help="start a request only while the predicted steady load (frame steps plus the prefills "
        "replacing ending streams) keeps the engine busy at most this fraction of the time (0 = no limit)",
    )
    p.add_argument(
        "--first-audio-budget-ms",
        type=float,
        default=float(_env("FIRST_AUDIO_BUDGET_MS", str(d.first_audio_budget_ms))),
        help="longest a request waits to start before it is refused with a retry hint (0 = no budget)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=int(_env("MAX_QUEUE", str(d.max_queue))),
        help="requests that may wait for a slot; beyond it they are rejected",
    )
    p.add_argument(
        "--credit-window-frames",
        type=int,
        default=int(_env("CREDIT_WINDOW_FRAMES", str(d.credit_window_frames))),
        help="frames a stream may generate ahead of its code2wav credit",
    )
    p.add_argument("--ring-vnodes", type=int, default=int(_env("RING_VNODES", str(d.ring_vnodes))))
    p.add_argument(
        "--health-interval-s", type=float, default=float(_env("HEALTH_INTERVAL_S", str(d.health_interval_s)))
    )
    p.add_argument(
        "--code2wav-stall-timeout-s",
        type=float,
        default=float(_env("CODE2WAV_STALL_TIMEOUT_S", str(d.code2wav_stall_timeout_s))),
        help="fail a stream whose code2wav replica answers nothing this long while frames wait, and "
        "take the replica off the ring (0 = off)",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> TalkerConfig:
    """Parse flags (env fallbacks) into a validated config; exits with a message on bad input."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        prefill_buckets = _int_list(a.prefill_buckets, "--prefill-buckets")
    except InvalidArgument as exc:
        parser.error(exc.message)
    config = TalkerConfig(
        internal_token=a.internal_token,
        tls=tls_from_args(a),
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        model=a.model,
        load_format=a.load_format,
        device=a.device,
        dtype=a.dtype,
        code2wav=_addresses(a.code2wav),
        speaker_cache=a.speaker_cache.strip(),
        speaker_cache_timeout_s=a.speaker_cache_timeout_s,
        max_batch=a.max_batch,
        engine=a.engine,
        prefix_cache_mb=a.prefix_cache_mb,
        max_len=a.max_len,
        context_step=a.context_step,
        prefill_buckets=prefill_buckets,
        max_prefill_tokens=a.max_prefill_tokens,
        decode_kernels=a.decode_kernels,
        sample_kernel=a.sample_kernel,
        urgent_lead_ms=a.urgent_lead_ms,
        max_lead_ms=a.max_lead_ms,
        prefill_coalesce_ms=a.prefill_coalesce_ms,
        min_step_interval_ms=a.min_step_interval_ms,
        admission_max_duty=a.admission_max_duty,
        admission_max_load=a.admission_max_load,
        first_audio_budget_ms=a.first_audio_budget_ms,
        max_queue=a.max_queue,
        credit_window_frames=a.credit_window_frames,
        ring_vnodes=a.ring_vnodes,
        health_interval_s=a.health_interval_s,
        code2wav_stall_timeout_s=a.code2wav_stall_timeout_s,
        drain_seconds=a.drain_seconds,
        max_connection_age_s=a.max_connection_age_s,
        max_connection_age_grace_s=a.max_connection_age_grace_s,
        gil_switch_interval_ms=a.gil_switch_interval_ms,
        log_level=a.log_level,
    )
    try:
        return config.validate()
    except InvalidArgument as exc:
        parser.error(exc.message)
        raise  # unreachable: parser.error exits
