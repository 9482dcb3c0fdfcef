"""talker configuration: a frozen dataclass from flags (env fallbacks `TTS_TALKER_*`), validated once."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from qtts.request.errors import InvalidArgument
from qtts.serving import service_config as common
from qtts.serving.service_config import check_connection_age, check_server_fields
from qtts.serving.settings import ServiceSettings, group, setting
from qtts.serving.tls import TlsConfig
from qtts.streams.chunk_plan import StartPlanner, StartPolicy
from qtts.tiny_model import DEFAULT_TINY_SNAPSHOT

from .admission import ENGINE_COSTS, STEP_FITS, check_engine_costs

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("eager", "graph")
ENGINE_PROCESS = ("auto", "on", "off")
PROMPT_BUILDS = ("batched", "pipelined")
# What --gpu-others-gib -1 leaves beside the KV slots for each engine sharing the talker's GPU:
# code2wav's decoder and graphs (20-27 GiB at --max-states 1024 --max-batch 256), the aligner's.
DECODER_GPU_GIB = 24.0
ALIGNER_GPU_GIB = 14.0
# qtts.engine.model_runner.KERNEL_CHOICES, copied so that parsing flags does not import torch
# (a test checks they are equal).
DECODE_KERNELS = SAMPLE_KERNELS = ("auto", "triton", "torch")


TALKER_GIL_SWITCH_INTERVAL_MS = 1.0


@dataclass(frozen=True)
class TalkerConfig:
    """Everything the talker needs at start-up; validated once by `validate()`."""

    host: str = common.host()
    port: int = common.port(50052)
    metrics_port: int = common.metrics_port(9102)
    # Empty: build (once) and serve a tiny random Base snapshot at DEFAULT_TINY_SNAPSHOT.
    model: str = setting(
        "",
        "snapshot folder, hub id, or a shipped config name with --load-format dummy",
        shown="a tiny random Base snapshot",
    )
    load_format: str = setting("auto", "how weights are loaded (dummy: random)", choices=LOAD_FORMATS)
    device: str = setting("cpu", "torch device (cpu, cuda, cuda:N)")
    dtype: str = setting("float32", choices=DTYPES)
    code2wav: tuple[str, ...] = setting(
        ("127.0.0.1:50053",), "comma-separated code2wav replica addresses (host:port)"
    )
    # Empty: no speaker_cache (voice prompts are computed locally; named voices are unavailable).
    speaker_cache: str = setting("127.0.0.1:50054", "speaker_cache address (empty = none)", parse=str.strip)
    speaker_cache_timeout_s: float = setting(2.0, "deadline of a speaker_cache call, seconds")
    max_batch: int = setting(64, "streams generated together in one batched step")
    # "eager": qtts.model.EagerGenerator; "graph": qtts.engine.GraphEngine (static KV slots, CUDA
    # graphs per batch bucket on a GPU; the same code runs eagerly on a CPU).
    engine: str = setting(
        "eager", "generation engine: eager (reference) or graph (CUDA-graph frame step)", choices=ENGINES
    )
    # The model, the prompts and the generation loop in a process of their own, so the loop that
    # drives the GPU never waits for the GIL behind the transport (services/talker/engine_process.py).
    engine_process: str = setting(
        "auto",
        "run the model and the generation loop in a process of their own (auto: on a CUDA device)",
        choices=ENGINE_PROCESS,
    )
    # How the engine process answers the prompts it builds on its CUDA stream (engine_process.py).
    prompt_builds: str = setting(
        "batched",
        "engine process: answer built prompts after one wait for up to 8 of them (batched), or each "
        "as soon as the GPU has run its kernels while the next ones are built (pipelined)",
        choices=PROMPT_BUILDS,
    )
    prefix_cache_mb: int = setting(
        1024, "graph engine: KV cache of voice-only prompt prefixes, MiB (0 = off)"
    )
    # The KV slots take a share of the GPU memory free when the engine starts; on one GPU with
    # code2wav, code2wav may still be capturing its graphs then. An H100 stack (2026-12-05) with
    # --max-batch 896 gave the talker 58.8 GiB and code2wav ran out at 19.3 GiB, mid-capture;
    # at 768 both fit, leaving code2wav 26.9 GiB (it needs 20-27 GiB at --max-states 1024
    # --max-batch 256). What the others already hold when the slots are sized is not left twice.
    gpu_others_gib: float = setting(
        -1.0,
        "graph engine: GPU memory other processes on this GPU need in all, GiB; the KV slots "
        "leave what they do not hold yet (-1 = 24 with --decoder-shares-gpu: code2wav's decoder "
        "and graphs; 14 more with --aligner-shares-gpu; else 0)",
    )
    # The launcher's one-GPU stack with --aligner (an H100 stack, 2026-12-06): the talker left
    # 24 GiB, code2wav took 22 and the aligner ran out at 11 GiB while capturing its graphs.
    aligner_shares_gpu: bool = setting(
        False,
        "the aligner stage (word timestamps) runs on this talker's GPU: --gpu-others-gib -1 "
        "leaves it 14 GiB (its model and graphs) beside code2wav's",
    )
    # Fewer attention-span buckets: faster start-up, more KV read per step.
    max_len: int = setting(1024, "graph engine: KV positions per slot (prompt + generated frames)")
    context_step: int = setting(128, "graph engine: attention-span bucket step of the captured frame steps")
    prefill_buckets: tuple[int, ...] = setting(
        (), "graph engine on CUDA: widths of captured prefill graphs, e.g. 64,128,256,512 (empty: eager)"
    )
    # Bounds a running stream's stall; must keep up with arrivals.
    max_prefill_tokens: int = setting(2048, "graph engine: prompt positions prefilled per step")
    decode_kernels: str = setting(
        "auto",
        "graph engine: frame-step decode layers: auto (fused Triton kernels on CUDA), triton or torch",
        choices=DECODE_KERNELS,
    )
    # torch: the PyTorch reference; same semantics, more kernels.
    sample_kernel: str = setting(
        "auto",
        "graph engine: codebook sampling: auto (one Triton kernel per codebook on CUDA), triton or torch",
        choices=SAMPLE_KERNELS,
    )
    # FP8 decoder-layer weights (qtts.engine.fp8), off by default: benchmarks/fp8_fidelity.py.
    weight_dtype: str = setting(
        "model",
        "graph engine on CUDA: decoder-layer linear weights: model (its dtype) or fp8",
        choices=("model", "fp8"),
    )
    # The talker's KV cache in float8_e4m3fn (RunnerConfig.kv_cache_dtype), off by default: half
    # the bytes a position, so twice the KV slots in the same memory and half the attention's reads;
    # benchmarks/fp8_fidelity.py ("kv8") measures what it changes.
    kv_cache_dtype: str = setting(
        "model",
        "graph engine: the talker's KV cache: model (its dtype) or fp8 (e4m3: twice the slots)",
        choices=("model", "fp8"),
    )
    # Playback-deadline scheduling (services/talker/deadline.py).
    urgent_lead_ms: float = setting(
        2000.0,
        "a step runs once a stream's listener would have less than this buffered after its next chunk",
    )
    max_lead_ms: float = setting(
        4000.0, "a stream this far ahead of its listener pauses, leaving the steps to others"
    )
    backlog_lead_ms: float = setting(
        0.0,
        "while requests wait to start or for their prefill, a playing stream steps at once only "
        "under this lead (the urgent lead otherwise), leaving the GPU to the waiting prompts "
        "(0 = off: the urgent lead always)",
    )
    first_chunk_step_ms: float = setting(
        40.0,
        "the longest predicted step a new stream's first chunk rides in: streams that are not "
        "urgent join it only up to this (urgent ones always do)",
    )
    # A new stream's first chunk (qtts/streams/chunk_plan.py): one frame unless the talker is busy.
    start_plan_busy_starting: int = setting(
        4,
        "a new stream starts with a 2-frame chunk while this many others have no first audio "
        "yet (0 = never on this count)",
    )
    start_plan_busy_streams: int = setting(
        64,
        "a new stream starts with a 2-frame chunk while this many streams generate or wait to "
        "(0 = never on this count)",
    )
    start_plan_burst_starting: int = setting(
        32,
        "a new stream starts with a 4-frame chunk while this many others have no first audio yet (0 = never)",
    )
    start_plan_heavy_streams: int = setting(
        384,
        "a new stream starts with an 8-frame chunk while this many streams generate or wait to (0 = never)",
    )
    start_plan_trip_chunks: int = setting(
        3,
        "a 1- or 2-frame start is checked against the trips through code2wav of each stream's "
        "first this many chunks (0 = of every chunk)",
    )
    # On an H100 at 100-150 requests/s (f76a2ea) the 2-frame start failed this check by its trip
    # bound in about 55% of the starts, which then waited two more frame steps, and no stream
    # gapped: an A/B of a lower margin on fresh stacks says whether it can give way.
    start_plan_margin: float = setting(
        1.6,
        "a 1- or 2-frame start is taken only while the recent steps and trips (90th percentiles) "
        "keep its early chunks ahead of the listener with this factor to spare (>= 1)",
    )
    prefill_coalesce_ms: float = setting(
        120.0,
        "while streams play, new prompts wait up to this long (or for 8 of them) to be "
        "prefilled in one step: all of it while requests queue for their start, otherwise "
        "scaled by the engine's predicted load (--prefill-coalesce-from-load, "
        "--prefill-coalesce-full-load) (0 = each at once)",
    )
    prefill_coalesce_from_load: float = setting(
        1.0,
        "predicted engine load below which new prompts do not wait for company (1 = capacity: "
        "they wait only while requests queue or past it)",
    )
    prefill_coalesce_full_load: float = setting(
        1.25,
        "predicted engine load from which new prompts wait all of --prefill-coalesce-ms for "
        "company (0 = always all of it)",
    )
    min_step_interval_ms: float = setting(
        0.0,
        "streams that are due but not short of audio step at most this often, so more of them "
        "join each step (0 = at once; first chunks and short streams always step at once)",
    )
    # Admission from measured capacity (services/talker/admission.py).
    admission_max_duty: float = setting(
        0.6,
        "start a request only while a step of every running stream is predicted to take at "
        "most this share of a frame (0 = no limit)",
    )
    admission_max_load: float = setting(
        0.8,
        "start a request only while the predicted steady load (frame steps plus the prefills "
        "replacing ending streams) keeps the engine busy at most this fraction of the time (0 = no limit)",
    )
    admission_step_fit: str = setting(
        "typical",
        "what admission takes a frame step to cost: typical (the recent steps' interquartile mean, "
        "contention from the other engines on this GPU included) or uncontended (the mean of their "
        "faster half: with --decoder-shares-gpu, the two engines' own costs summed)",
        choices=STEP_FITS,
    )
    admission_engine_costs: str = setting(
        "sum",
        "with --decoder-shares-gpu, how admission combines the talker's and the decoder's costs: "
        "sum (the engines take turns on the GPU) or overlap (they run side by side under MPS, each "
        "engine's measured cost holding its waits for the other: the busier engine bounds; needs "
        "--admission-step-fit typical)",
        choices=ENGINE_COSTS,
    )
    decoder_frame_us: float = setting(
        0.0,
        "GPU time code2wav's decoder spends per stream and frame on this talker's GPU "
        "(benchmarks/code2wav_decode.py measures it): admission counts it beside the talker's own "
        "load; with --decoder-shares-gpu a prior that code2wav's measured cost replaces, without "
        "it a fixed figure (0 = the decoder costs this GPU nothing)",
    )
    # Off by default: in a deployment code2wav runs in pods of its own, on other GPUs, and its
    # cost there must not lower this talker's capacity; one-GPU stacks (the launcher, the
    # benchmarks) turn it on.
    decoder_shares_gpu: bool = setting(
        False,
        "code2wav runs on this talker's GPU: admission counts the decode cost code2wav measures "
        "and publishes on its credit grants (--decoder-frame-us until it has)",
    )
    first_audio_budget_ms: float = setting(
        3000.0, "longest a request waits to start before it is refused with a retry hint (0 = no budget)"
    )
    # The margin between the wait a new request may be predicted and the budget it is held to once
    # queued (admission.py); on a CPU stand-in at 768 streams, 1.0 refused 4% of the refusals
    # about a second after they queued.
    queue_budget_share: float = setting(
        0.5,
        "a new request queues only while its predicted start is within this share of "
        "--first-audio-budget-ms; once queued, only a start predicted past the whole budget refuses it",
    )
    # Off by default until an A/B on fresh stacks says what it does to a closed loop's opening
    # (room.py, SeenCalls.share).
    room_share_floor: float = setting(
        0.0,
        "each gateway asking for room gets at least this fraction of an equal split of it, whatever "
        "its recent calls (0 = by its calls alone; 1 = at least 1/N each, so N gateways may send up "
        "to twice the room and the talker refuses the excess itself)",
    )
    admission_trace: str = setting(
        "",
        "write every admission decision (plans, steps, the room sent to the gateways) as JSON lines "
        "to this file, to see why a burst was refused ('' = off; services/talker/admission_trace.py)",
    )
    # Beyond max_batch; more are rejected (RESOURCE_EXHAUSTED).
    max_queue: int = setting(256, "requests that may wait for a slot; beyond it they are rejected")
    # A stream's send buffer bound.
    credit_window_frames: int = setting(8, "frames a stream may generate ahead of its code2wav credit")
    ring_vnodes: int = setting(160, "virtual nodes per code2wav replica on the hashing ring")
    code2wav_sessions: bool = setting(
        True,
        "carry the streams on one DecodeSession call per code2wav replica (one message a loop turn "
        "for all of them) instead of a Decode call each; a replica without it gets Decode calls",
    )
    health_interval_s: float = setting(2.0, "how often each code2wav replica's health is checked, seconds")
    # A hung decoder process can still answer keepalive pings and health checks.
    code2wav_stall_timeout_s: float = setting(
        30.0,
        "fail a stream whose code2wav replica answers nothing this long while frames wait, and "
        "take the replica off the ring (0 = off)",
    )
    drain_seconds: float = common.drain_seconds(30.0)
    # Client connections are closed after this long so gateways/talkers re-resolve (0 = never);
    # streams on an aged connection get the grace (0 = drain_seconds) to finish.
    max_connection_age_s: float = common.max_connection_age_s()
    max_connection_age_grace_s: float = common.max_connection_age_grace_s()
    # sys.setswitchinterval for this process: 1 ms, not CPython's 5 ms, so the engine thread gets
    # the GIL back sooner after each CUDA call while the event loop runs.
    gil_switch_interval_ms: float = common.gil_switch_interval_ms(TALKER_GIL_SWITCH_INTERVAL_MS)
    log_level: str = common.log_level()
    # Shared secret of the services (qtts/serving/internal_auth.py); empty: off.
    internal_token: str = common.internal_token()
    # TLS / mutual TLS on the gRPC port and to code2wav and speaker_cache (qtts/serving/tls.py);
    # off by default.
    tls: TlsConfig = group(TlsConfig(), "tls", what="gRPC between the services")

    @property
    def gpu_others_bytes(self) -> int:
        """`--gpu-others-gib` in bytes, -1 resolved."""
        gib = self.gpu_others_gib
        if gib == -1:
            gib = (DECODER_GPU_GIB if self.decoder_shares_gpu else 0.0) + (
                ALIGNER_GPU_GIB if self.aligner_shares_gpu else 0.0
            )
        return int(gib * (1 << 30))

    @property
    def start_policy(self) -> StartPolicy:
        """The `--start-plan-*` thresholds of a new stream's first chunk."""
        return StartPolicy(
            self.start_plan_busy_starting,
            self.start_plan_busy_streams,
            self.start_plan_burst_starting,
            self.start_plan_heavy_streams,
        )

    def start_planner(self) -> StartPlanner:
        """A new planner of streams' first chunks by the `--start-plan-*` flags."""
        return StartPlanner(
            self.start_policy, margin=self.start_plan_margin, trip_chunks=self.start_plan_trip_chunks
        )

    @property
    def model_path(self) -> str:
        return self.model or str(DEFAULT_TINY_SNAPSHOT)

    def validate(self) -> TalkerConfig:
        """Raise `InvalidArgument` with a clear message for an unusable configuration."""
        check_server_fields(self)
        check_connection_age(self)
        self.tls.validate()
        self._validate_model_and_code2wav()
        self._validate_engine()
        self._validate_batching()
        self._validate_streams()
        return self

    def _validate_model_and_code2wav(self) -> None:
        """The checkpoint's load format and dtype, and the code2wav addresses."""
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

    def _validate_engine(self) -> None:
        """The engine, its process, prefix cache, prefill size and kernel choices."""
        if self.engine not in ENGINES:
            raise InvalidArgument(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine_process not in ENGINE_PROCESS:
            raise InvalidArgument(
                f"--engine-process must be one of {', '.join(ENGINE_PROCESS)}, got {self.engine_process!r}"
            )
        if self.prompt_builds not in PROMPT_BUILDS:
            raise InvalidArgument(
                f"--prompt-builds must be one of {', '.join(PROMPT_BUILDS)}, got {self.prompt_builds!r}"
            )
        if self.gpu_others_gib < 0 and self.gpu_others_gib != -1:
            raise InvalidArgument(f"--gpu-others-gib must be >= 0 or -1 (auto), got {self.gpu_others_gib:g}")
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

    def _validate_batching(self) -> None:
        """Batch size, context lengths, step pacing, deadlines and admission limits."""
        if self.max_batch < 1:
            raise InvalidArgument(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.max_len < 2 or self.context_step < 1 or any(w < 1 for w in self.prefill_buckets):
            raise InvalidArgument(
                f"--max-len must be >= 2, --context-step >= 1 and --prefill-buckets positive, got "
                f"{self.max_len}, {self.context_step}, {list(self.prefill_buckets)}"
            )
        if self.prefill_coalesce_ms < 0 or self.min_step_interval_ms < 0:
            raise InvalidArgument("--prefill-coalesce-ms and --min-step-interval-ms must be >= 0")
        lo, hi = self.prefill_coalesce_from_load, self.prefill_coalesce_full_load
        if hi != 0 and not 0 <= lo < hi:
            raise InvalidArgument(
                f"--prefill-coalesce-from-load and --prefill-coalesce-full-load must satisfy "
                f"0 <= from < full (or full 0), got {lo:g} and {hi:g}"
            )
        if not 0 <= self.urgent_lead_ms <= self.max_lead_ms:
            raise InvalidArgument(
                f"--urgent-lead-ms and --max-lead-ms must satisfy 0 <= urgent <= max, got "
                f"{self.urgent_lead_ms:g} and {self.max_lead_ms:g}"
            )
        if self.backlog_lead_ms and not 300.0 <= self.backlog_lead_ms <= self.urgent_lead_ms:
            raise InvalidArgument(
                f"--backlog-lead-ms must be 0 (off) or between 300 and --urgent-lead-ms "
                f"({self.urgent_lead_ms:g}), got {self.backlog_lead_ms:g}"
            )
        plan_flags = {
            "--start-plan-busy-starting": self.start_plan_busy_starting,
            "--start-plan-busy-streams": self.start_plan_busy_streams,
            "--start-plan-burst-starting": self.start_plan_burst_starting,
            "--start-plan-heavy-streams": self.start_plan_heavy_streams,
            "--start-plan-trip-chunks": self.start_plan_trip_chunks,
        }
        for flag, value in plan_flags.items():
            if value < 0:
                raise InvalidArgument(f"{flag} must be >= 0 (0 = off), got {value}")
        if not self.start_plan_margin >= 1:  # a NaN too
            raise InvalidArgument(f"--start-plan-margin must be >= 1, got {self.start_plan_margin:g}")
        if self.first_chunk_step_ms <= 0:
            raise InvalidArgument(f"--first-chunk-step-ms must be > 0, got {self.first_chunk_step_ms:g}")
        if not 0 <= self.room_share_floor <= 1:
            raise InvalidArgument(f"--room-share-floor must be in [0, 1], got {self.room_share_floor}")
        if not 0 < self.queue_budget_share <= 1:
            raise InvalidArgument(f"--queue-budget-share must be in (0, 1], got {self.queue_budget_share}")
        if self.admission_max_duty < 0 or self.admission_max_load < 0 or self.first_audio_budget_ms < 0:
            raise InvalidArgument(
                "--admission-max-duty, --admission-max-load and --first-audio-budget-ms must be >= 0"
            )
        if not 0 <= self.decoder_frame_us <= 80_000:
            raise InvalidArgument(
                f"--decoder-frame-us must be between 0 and 80000 (a frame), got {self.decoder_frame_us:g}"
            )
        try:
            check_engine_costs(self.admission_engine_costs, self.admission_step_fit)
        except ValueError as exc:
            # (an unknown value is refused by the flag's choices first: here, the pairing)
            raise InvalidArgument(
                f"--admission-engine-costs overlap needs --admission-step-fit typical: {exc}"
            ) from exc

    def _validate_streams(self) -> None:
        """The queue, per-stream credit, the code2wav ring, timeouts and the drain."""
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


SETTINGS = ServiceSettings(TalkerConfig, "talker", "python -m services.talker", __doc__)


def build_parser() -> argparse.ArgumentParser:
    return SETTINGS.parser()


def config_from_args(argv: Sequence[str] | None = None) -> TalkerConfig:
    """Parse flags (env fallbacks) into a validated config; exits 2 with one line on bad input."""
    parser = build_parser()
    try:
        return SETTINGS.parse(argv, parser).validate()
    except InvalidArgument as exc:
        parser.exit(2, f"{parser.prog}: error: {exc.message}\n")
