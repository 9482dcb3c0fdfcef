"""Sizes and switches of the talker's model runner: `RunnerConfig`, validated once.

A plain dataclass with its choices; the runner reads it once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtts.engine.fp8 import WEIGHT_DTYPES

# The talker KV cache's element type (RunnerConfig.kv_cache_dtype).
KV_CACHE_DTYPES = ("model", "fp8")

# No bucket of 1: a single stream padded to 2 rows ran faster (the M=1 matmuls take slower
# kernels). Above 256 the buckets are an eighth apart: a step's time grows with its bucket, so
# 574 streams should not pay for 1024.
DEFAULT_BATCH_BUCKETS = (
    2,
    4,
    8,
    16,
    32,
    64,
    96,
    128,
    192,
    256,
    320,
    384,
    448,
    512,
    640,
    768,
    896,
    1024,
    1280,
    1536,
    1792,
    2048,
)
ATTENTION_IMPLS = ("auto", "sdpa", "matmul")
KERNEL_CHOICES = ("auto", "triton", "torch")
DECODE_KERNELS = SAMPLE_KERNELS = KERNEL_CHOICES


@dataclass(frozen=True)
class RunnerConfig:
    """Sizes and switches of the model runner (validated once)."""

    max_len: int = 1024  # KV positions per slot (prompt + frames)
    max_batch: int = 256  # most slots (= most concurrent streams)
    num_slots: int | None = None  # None: max_batch, capped by measured free memory on CUDA
    kv_memory_fraction: float = 0.9  # of the free memory after weights, for slots
    reserve_bytes: int = 4 << 30  # kept free for graphs, activations and prefill
    # GPU memory other processes on the GPU (code2wav beside the talker) need in all; what they
    # do not hold yet when the slots are sized is left free too (kv_slots.kv_budget_bytes).
    others_bytes: int = 0
    max_trailing: int = 512  # trailing text embeddings held per slot
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    # Attention spans captured; the decode reads the whole bucket of every row, so finer buckets
    # read less KV. None: every multiple of `context_step` up to max_len.
    context_buckets: tuple[int, ...] | None = None
    context_step: int = 128
    use_cuda_graphs: bool = True
    pad_to_buckets: bool = False  # eager steps use the graph shapes too (tests padding on the CPU)
    max_candidates: int | None = None  # sampling candidates per row (None: the whole vocabulary)
    # "sdpa" (PyTorch SDPA with GQA, the model core's numerics), "matmul" (matmul-softmax-matmul),
    # or "auto": "matmul" on CUDA (fastest measured with compiled layers), "sdpa" elsewhere.
    # benchmarks/runner_variants.py holds the grouped-SDPA variant that was measured against them.
    talker_attention: str = "auto"
    predictor_attention: str = "matmul"  # the <= 16-position attention; SDPA was slow at large B
    # Decode with concatenated q|k|v and gate|up weights and fused RMSNorm (fewer kernels per layer;
    # rounding differs slightly from the model core). None: on CUDA only.
    fast_path: bool | None = None
    # torch.compile the per-layer elementwise work and the sampler (fast path only; adds about a
    # minute of start-up). None: on CUDA only.
    compile_layers: bool | None = None
    # The frame step's decode layers (talker and predictor) on the fast path: "triton" runs the fused
    # kernels of qtts.engine.triton_ops (about 9 kernels a layer instead of about 23; attention reads
    # each row's own length, so one graph per batch bucket serves every context), "torch" the
    # PyTorch ops below, "auto" Triton on CUDA when it is installed.
    decode_kernels: str = "auto"
    # With the fused decode kernels: the few-row matmuls whose weight shapes are listed in
    # triton_ops.SKINNY_RULES (measured faster than cuBLAS there) take the Triton skinny kernel.
    # None: on whenever the fused decode is.
    skinny_matmul: bool | None = None
    # With the fused decode kernels: the q/k norm, RoPE, KV store and attention of a layer as one
    # kernel (triton_qkv_attention) instead of two, for steps of at most `fused_qkv_max_rows`
    # tokens. None: on CUDA where a start-up self-check of the kernel against the two passes (else
    # the two kernels, with a warning). Small batches are launch-bound: one kernel fewer a layer
    # is ~100 fewer a frame step. At large batches the two kernels stay: the attention is
    # bandwidth-bound there, and a longer prologue per program would delay its first loads.
    fused_qkv_attention: bool | None = None
    fused_qkv_max_rows: int = 64
    # Sampling of the 16 codebooks: "triton" runs qtts.engine.triton_sampling (one kernel per
    # codebook that also computes the row's counter uniform; no sort), "torch" the PyTorch reference
    # sampler.sample_rows (same semantics; it sorts), "auto" Triton on CUDA when it is installed and
    # `max_candidates` is not set (the kernel has no candidate cap).
    sample_kernel: str = "auto"
    # "fp8": the decoder layers' linear weights (talker and predictor) in float8_e4m3fn with
    # per-output-channel scales, activations quantized per token (qtts.engine.fp8; needs the fast
    # path; FP8 tensor cores on sm90, a dequantizing reference elsewhere). "model": the model dtype.
    weight_dtype: str = "model"
    # With FP8 weights: products of fewer rows (tokens) than this keep the model-dtype weights (an
    # extra copy of the layers' linears). H200 at a301b03: FP8 at batch 1 / 256 / 1024 took 6.20 /
    # 9.90 / 22.78 ms against bf16's 4.36 / 8.72 / 23.63. 0: FP8 at every size.
    fp8_min_rows: int = 512
    # "fp8": the talker's KV cache in float8_e4m3fn (no scale), half the bytes a position: twice
    # the slots in the same memory, and the frame step's attention reads half the bytes. Needs the
    # fused decode kernels and the packed prefill (they round into the cache and widen out of it);
    # the predictor's per-frame K/V stay in the model dtype. "model": the model dtype.
    kv_cache_dtype: str = "model"
    prefix_cache_bytes: int = 0  # GPU-local prompt-prefix KV cache (0: off)
    # Packed prefill: the step's prompt chunks concatenated on one token axis, one GEMM per linear
    # per layer and a varlen causal attention (qtts.engine.packed_prefill). None: on with the fast
    # path. Off: the per-row prefill below (prefill_buckets / prefill_rows).
    prefill_packed: bool | None = None
    # Packed prefill on CUDA with graphs: token counts captured as graphs (a call is padded up to
    # the smallest that holds it; larger calls run eagerly). Steps of 64 to 512, then 128 to
    # 1,024, 256 to 2,048 and 512 to 8,192: padding stays under ~1/8. Eager calls are host-bound
    # far past 1,000 tokens (H200 at a301b03: 300 positions 45.8 us each eager against 11.4
    # graphed, 2,400 positions 6.5 against ~5.8).
    prefill_token_buckets: tuple[int, ...] = (
        *range(64, 513, 64),
        *range(640, 1025, 128),
        *range(1280, 2049, 256),
        *range(2560, 8193, 512),
    )
    # Per-row prefill (prefill_packed off), fast path on CUDA: capture the prefill of one prompt
    # chunk as CUDA graphs at these widths
    # (positions, padded up); wider chunks and CPU runs take the eager ragged batch. Empty: off.
    prefill_buckets: tuple[int, ...] = ()
    # Chunks of one width bucket go through one graph in batches of these many rows (padding rows
    # write only the scratch column): fewer, larger replays when several prompts arrive at once.
    prefill_rows: tuple[int, ...] = (1, 2, 4, 8)

    def __post_init__(self) -> None:
        if self.max_len < 2 or self.max_batch < 1 or self.max_trailing < 0 or self.context_step < 1:
            raise ValueError("max_len >= 2, max_batch >= 1, max_trailing >= 0 and context_step >= 1 required")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError("kv_memory_fraction must be in (0, 1]")
        if self.reserve_bytes < 0 or self.others_bytes < 0:
            raise ValueError("reserve_bytes and others_bytes must be >= 0")
        for name in ("talker_attention", "predictor_attention"):
            if getattr(self, name) not in ATTENTION_IMPLS:
                raise ValueError(f"{name} must be one of {ATTENTION_IMPLS}")
        if self.decode_kernels not in DECODE_KERNELS:
            raise ValueError(f"decode_kernels must be one of {DECODE_KERNELS}")
        if self.fp8_min_rows < 0:
            raise ValueError("fp8_min_rows must be >= 0")
        if self.fused_qkv_max_rows < 0:
            raise ValueError("fused_qkv_max_rows must be >= 0")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        if self.sample_kernel not in SAMPLE_KERNELS:
            raise ValueError(f"sample_kernel must be one of {SAMPLE_KERNELS}")
        if self.sample_kernel == "triton" and self.max_candidates:
            raise ValueError("sample_kernel='triton' has no candidate cap: leave max_candidates unset")
        if any(b < 1 for b in self.batch_buckets) or not self.batch_buckets:
            raise ValueError("batch_buckets must be positive")
        if any(b < 1 for b in self.prefill_token_buckets):
            raise ValueError("prefill_token_buckets must be positive")
        if any(b < 1 for b in self.prefill_buckets) or not self.prefill_rows or min(self.prefill_rows) < 1:
            raise ValueError("prefill_buckets and prefill_rows must be positive (prefill_rows non-empty)")

    def resolved_context_buckets(self) -> tuple[int, ...]:
        if self.context_buckets:
            return tuple(sorted({min(c, self.max_len) for c in self.context_buckets} | {self.max_len}))
        steps = range(self.context_step, self.max_len, self.context_step)
        return (*steps, self.max_len)
