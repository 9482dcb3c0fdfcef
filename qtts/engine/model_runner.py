"""All tensor work of the talker engine: static KV slots, prefill, the batched frame step, graphs.

The runner takes its parameters from the loaded `TalkerBundle` (`bundle.talker`,
`bundle.code_predictor`) and never loads weights itself. Prefill runs the bundle's own decoder
stack (eager, ragged batches). The frame step is written here with static shapes so that it can
be captured as one CUDA graph per (batch bucket, context bucket):

    talker decode of every row at its own position (KV written in its slot, attention over the
    first `ctx` positions) -> codebook-0 logits -> penalty / masks / sampling -> code predictor:
    2-position start and 14 one-token steps on a small per-frame KV -> 15 samples -> the next
    talker input (sum of the 16 code embeddings + the row's next trailing text embedding).

Row i of a batch bucket is KV slot i (the scheduler keeps occupied slots dense); rows that must not
advance (padding, prefilling, skipped) carry `active = False`: their KV write goes to a scratch
column past `max_len` and every per-slot state update is masked, so running them is harmless.
All per-slot state lives in device tensors updated inside the graph; the host writes one bool
mask before a replay and reads the [B, 16] codes after it.

Neighbours: `runner_config.py` (RunnerConfig), `fused_layers.py` (the decode layer functions),
`frame_step.py` (FrameStepMixin: the frame step itself), `slot_state.py` (SlotStateMixin: the
per-slot state columns and the eager bookkeeping copies), `prefill.py` (PrefillMixin: prompt
chunks into KV).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from qtts.engine import sampler
from qtts.engine.fp8 import dispatching as fp8_dispatching
from qtts.engine.fp8 import quantize_layer
from qtts.engine.frame_step import FrameStepMixin
from qtts.engine.fused_layers import fast_out_mlp, fast_predictor_layer, fast_qkv, fuse_layer
from qtts.engine.kv_slots import kv_budget_bytes, slots_for_budget
from qtts.engine.prefill import PrefillMixin
from qtts.engine.prefix_cache import PrefixCache
from qtts.engine.runner_config import (
    ATTENTION_IMPLS,
    DECODE_KERNELS,
    DEFAULT_BATCH_BUCKETS,
    KERNEL_CHOICES,
    SAMPLE_KERNELS,
    RunnerConfig,
)
from qtts.engine.slot_state import (
    F_PTEMP,
    F_PTOPP,
    F_REP,
    F_TEMP,
    F_TOPP,
    I_FRAME,
    I_GREEDY,
    I_MINF,
    I_PGREEDY,
    I_POS,
    I_PTOPK,
    I_SEED,
    I_TLEN,
    I_TOPK,
    NUM_F,
    NUM_I,
    SlotStateMixin,
)
from qtts.model.layers import KVCache

__all__ = [
    "ATTENTION_IMPLS",
    "DECODE_KERNELS",
    "DEFAULT_BATCH_BUCKETS",
    "KERNEL_CHOICES",
    "SAMPLE_KERNELS",
    "F_PTEMP",
    "F_PTOPP",
    "F_REP",
    "F_TEMP",
    "F_TOPP",
    "I_FRAME",
    "I_GREEDY",
    "I_MINF",
    "I_PGREEDY",
    "I_POS",
    "I_PTOPK",
    "I_SEED",
    "I_TLEN",
    "I_TOPK",
    "NUM_F",
    "NUM_I",
    "ModelRunner",
    "RunnerConfig",
]

log = logging.getLogger(__name__)


class ModelRunner(FrameStepMixin, SlotStateMixin, PrefillMixin):
    """Owns the KV cache, the per-slot state, the frame step and its CUDA graphs."""

    # Fast path: the predictor carries its per-frame K/V as concatenated tensors (one compiled
    # function per layer) instead of writing `pk_cache`; benchmarks/runner_variants.py measures the writes.
    predictor_carry_kv = True

    def __init__(self, bundle, config: RunnerConfig) -> None:
        self.cfg = config
        self.talker = bundle.talker
        self.predictor = bundle.code_predictor
        self.device = torch.device(bundle.device)
        self.dtype = bundle.dtype
        tcfg = self.talker.cfg
        self.tdec, self.pdec = tcfg.decoder, tcfg.predictor.decoder
        self.hidden = self.tdec.hidden_size
        self.vocab0 = tcfg.vocab_size
        self.num_codebooks = tcfg.num_code_groups
        self.eos_id = tcfg.codec_eos_id
        self.max_len = config.max_len
        self.scratch = config.max_len  # the extra KV column inactive rows write into
        self.talker_attention = config.talker_attention
        if self.talker_attention == "auto":
            self.talker_attention = "matmul" if self.device.type == "cuda" else "sdpa"
        self.predictor_attention = (
            "sdpa" if config.predictor_attention == "auto" else config.predictor_attention
        )
        self.fast_path = self.device.type == "cuda" if config.fast_path is None else config.fast_path
        self.fp8 = config.weight_dtype == "fp8"
        if self.fp8 and not self.fast_path:
            raise ValueError("weight_dtype='fp8' needs the fast path")
        # The talker KV cache's element type (the predictor's per-frame K/V keep the model dtype).
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        # Fused weights first: the KV sizing below measures the memory left after them.
        self.talker_weights = self._layer_weights(self.talker.model.layers)
        self.predictor_weights = self._layer_weights(self.predictor.model.layers)
        self._choose_kernels(config)
        if config.kv_cache_dtype == "fp8" and not (self.fused_decode and config.prefill_packed is not False):
            raise ValueError(
                "kv_cache_dtype='fp8' needs the fused decode kernels and the packed prefill "
                "(decode_kernels auto on CUDA or triton; prefill_packed not off)"
            )
        self.num_slots = self._size_slots()
        self.batch_buckets = tuple(
            sorted({b for b in config.batch_buckets if b < self.num_slots} | {self.num_slots})
        )
        # Fused attention reads each row's own length: one context bucket (the whole slot) is enough.
        self.context_buckets = (self.max_len,) if self.fused_decode else config.resolved_context_buckets()
        self._allocate()
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes > 0 else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.use_graphs = config.use_cuda_graphs and self.device.type == "cuda"
        self._init_prefill(config)

    def _layer_weights(self, layers) -> list:
        """The fast path's per-layer weights (FP8 linears with weight_dtype="fp8"); none otherwise."""
        if not self.fast_path:
            return []
        fused = [fuse_layer(layer) for layer in layers]
        return [quantize_layer(w, self.cfg.fp8_min_rows) for w in fused] if self.fp8 else fused

    def _choose_kernels(self, config: RunnerConfig) -> None:
        """The layer functions, the fused decode and sampling kernel modules and the matmul, compiled
        where `compile_layers` asks (fast path only)."""
        self._qkv_fn, self._out_fn, self._sample = fast_qkv, fast_out_mlp, sampler.sample_rows
        self._c0_logits = sampler.codebook0_logits
        if config.decode_kernels == "triton" and not self.fast_path:
            raise ValueError("decode_kernels='triton' needs the fast path")
        # The fused decode kernels' module (None: the PyTorch decode layers).
        self._fused_kernels = (
            self._kernel_module(config.decode_kernels, "triton_ops", "decode_kernels")
            if self.fast_path
            else None
        )
        self.fused_decode = self._fused_kernels is not None
        self.fused_qkv = self._use_fused_qkv(config.fused_qkv_attention)
        self._pred_layer_fn = fast_predictor_layer
        skinny = self.fused_decode if config.skinny_matmul is None else config.skinny_matmul
        if skinny and not self.fused_decode:
            raise ValueError("skinny_matmul needs the fused decode kernels")
        self._linear = self._fused_kernels.linear if skinny else F.linear
        if self.fp8:
            self._linear = fp8_dispatching(self._linear)
        # The sampling kernel's module (None: sampler.sample_rows). It has no candidate cap, so "auto"
        # with max_candidates set takes the reference.
        sample_choice = (
            "torch" if config.sample_kernel == "auto" and config.max_candidates else config.sample_kernel
        )
        self._sampling_kernels = self._kernel_module(sample_choice, "triton_sampling", "sample_kernel")
        compile_layers = (
            self.device.type == "cuda" if config.compile_layers is None else config.compile_layers
        )
        if self.fast_path and compile_layers:
            self._compile_layer_fns(layers=not self.fp8)  # FP8 weights: the layer functions stay eager

    def _use_fused_qkv(self, choice: bool | None) -> bool:
        """Whether the fused decode runs `qkv_attention` (RunnerConfig.fused_qkv_attention)."""
        if choice is False or (choice is None and self.device.type != "cuda"):
            return False
        if not self.fused_decode:
            if choice:
                raise ValueError("fused_qkv_attention needs the fused decode kernels")
            return False
        from qtts.engine.triton_ops import self_check

        shapes = ((self.tdec, 64), (self.pdec, 32))
        ok = all(
            self_check(self.device, self.dtype, d.num_heads, d.num_kv_heads, d.head_dim, bn)
            for d, bn in shapes
        )
        if not ok:
            if choice:
                raise ValueError("fused_qkv_attention failed its self-check on this device")
            log.warning("fused q/k/v attention kernel failed its self-check: running the two kernels")
        return ok

    def _compile_layer_fns(self, layers: bool = True) -> None:
        """torch.compile the fast path's per-layer functions (`layers`) and the sampler."""
        # Every batch bucket, predictor step and prefill width is its own variant: above the
        # default limit of 8, dynamo silently runs the rest uncompiled. Raise the limit for this
        # process.
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
        # Batch, positions and sequence length vary across buckets and predictor steps.
        self._sample = torch.compile(sampler.sample_rows, dynamic=True)
        self._c0_logits = torch.compile(sampler.codebook0_logits, dynamic=True)
        if layers:
            self._qkv_fn = torch.compile(fast_qkv, dynamic=True)
            self._out_fn = torch.compile(fast_out_mlp, dynamic=True)
            self._pred_layer_fn = torch.compile(fast_predictor_layer, dynamic=True)

    def _kernel_module(self, choice: str, module_name: str, setting: str):
        """The Triton kernel module `qtts.engine.<module_name>` when `choice` ("auto", "triton" or
        "torch") selects it on this device, else None ("auto": CUDA with Triton installed)."""
        if choice == "torch":
            return None
        import importlib

        module = importlib.import_module(f"qtts.engine.{module_name}")
        if choice == "triton":
            if not module.available(self.device):
                raise ValueError(f"{setting}='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
            return module
        return module if self.device.type == "cuda" and module.available(self.device) else None

    # -- sizing and allocation ---------------------------------------------------------------
    def bytes_per_position(self) -> int:
        d = self.tdec
        return 2 * d.num_layers * d.num_kv_heads * d.head_dim * torch.finfo(self.kv_dtype).bits // 8

    def bytes_per_slot_state(self) -> int:
        """Per-slot bytes besides the talker KV: trailing text, penalty mask, predictor KV."""
        elem = torch.finfo(self.dtype).bits // 8
        p = self.pdec
        pred_kv = 2 * p.num_layers * p.num_kv_heads * (self.num_codebooks + 1) * p.head_dim * elem
        return (
            (self.cfg.max_trailing + 2) * self.hidden * elem + self.vocab0 + pred_kv + 8 * NUM_I + 4 * NUM_F
        )

    def _size_slots(self) -> int:
        cap = self.cfg.num_slots or self.cfg.max_batch
        if self.device.type != "cuda" or self.cfg.num_slots is not None:
            return cap
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget_bytes(
            free,
            total,
            torch.cuda.memory_reserved(self.device),
            reserve=self.cfg.reserve_bytes,
            others=self.cfg.others_bytes,
            prefix_cache=self.cfg.prefix_cache_bytes,
            fraction=self.cfg.kv_memory_fraction,
        )
        per_pos = self.bytes_per_position() + self.bytes_per_slot_state() // (self.max_len + 1) + 1
        n = slots_for_budget(budget, self.max_len, per_pos, cap)
        if n < 1:
            raise RuntimeError(f"not enough GPU memory for one KV slot of {self.max_len} positions")
        if n < cap:
            log.warning("KV memory fits %d slots of %d positions (asked for %d)", n, self.max_len, cap)
        return n

    def _allocate(self) -> None:
        s, dev, dt = self.num_slots, self.device, self.dtype
        t, p = self.tdec, self.pdec
        # [layers, slots, kv_heads, max_len + 1 (scratch), head_dim]
        shape = (t.num_layers, s, t.num_kv_heads, self.max_len + 1, t.head_dim)
        self.k_cache = torch.zeros(shape, device=dev, dtype=self.kv_dtype)
        self.v_cache = torch.zeros(shape, device=dev, dtype=self.kv_dtype)
        self.kv_view = KVCache(keys=list(self.k_cache.unbind(0)), values=list(self.v_cache.unbind(0)))
        pshape = (p.num_layers, s, p.num_kv_heads, self.num_codebooks + 1, p.head_dim)
        self.pk_cache = torch.zeros(pshape, device=dev, dtype=dt)
        self.pv_cache = torch.zeros(pshape, device=dev, dtype=dt)
        self.next_embed = torch.zeros(s, self.hidden, device=dev, dtype=dt)
        self.trailing = torch.zeros(s, self.cfg.max_trailing + 1, self.hidden, device=dev, dtype=dt)
        self.seen = torch.zeros(s, self.vocab0, device=dev, dtype=torch.bool)
        self.slot_ints = torch.zeros(s, NUM_I, device=dev, dtype=torch.long)
        self.slot_floats = torch.ones(s, NUM_F, device=dev, dtype=torch.float32)
        self.active = torch.zeros(s, device=dev, dtype=torch.bool)
        self.codes_out = torch.zeros(s, self.num_codebooks, device=dev, dtype=torch.long)
        self.rows = torch.arange(s, device=dev)
        self.suppressed, self.eos_mask = sampler.codebook0_masks(self.vocab0, self.eos_id, dev)
        pred_positions = torch.arange(self.num_codebooks + 1, device=dev)[None]
        self.pred_cos, self.pred_sin = self.predictor.model.rotary(pred_positions, dt)  # [1, P, D]
        self.start_mask = torch.tril(torch.ones(2, 2, device=dev, dtype=torch.bool))[None, None]
        # Fused predictor: token m of a 2-token start is (row m // 2, position m % 2); a one-token
        # step at position p reads row p of `pred_step_pos` (every slot at p).
        self.pred_start_rows = torch.arange(s, device=dev).repeat_interleave(2)
        self.pred_start_pos = torch.arange(2, device=dev).repeat(s)
        self.pred_start_cos = self.pred_cos[0, :2].repeat(s, 1)
        self.pred_start_sin = self.pred_sin[0, :2].repeat(s, 1)
        self.pred_step_pos = (
            torch.arange(self.num_codebooks + 1, device=dev)[:, None].expand(-1, s).contiguous()
        )
        self._active_host = torch.zeros(s, dtype=torch.bool, pin_memory=dev.type == "cuda")

    def bucket(self, n_rows: int, ctx_needed: int) -> tuple[int, int]:
        n = next((b for b in self.batch_buckets if b >= n_rows), self.num_slots)
        ctx = next((c for c in self.context_buckets if c >= ctx_needed), self.max_len)
        return n, ctx

    @torch.inference_mode()
    def decode(self, num_rows: int, active_slots: Seq[int], ctx_needed: int) -> torch.Tensor:
        """One frame for the active slots (all < num_rows). Returns codes [num_rows, 16] on the CPU."""
        if self.use_graphs or self.cfg.pad_to_buckets:
            n, ctx = self.bucket(num_rows, ctx_needed)
        else:
            n, ctx = num_rows, min(ctx_needed, self.max_len)
        host = self._active_host[:n]
        host.zero_()
        host[torch.as_tensor(list(active_slots), dtype=torch.long)] = True
        self.active[:n].copy_(host, non_blocking=True)
        graph = self.graphs.get((n, ctx)) if self.use_graphs else None
        if graph is not None:
            graph.replay()
        else:
            self._frame_step(n, ctx)
        return self.codes_out[:num_rows].to("cpu")

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture the frame step for every (batch bucket, context bucket), largest first, in one
        memory pool. Rows are inactive during capture, so no state changes."""
        if not self.use_graphs:
            return
        self.active.zero_()
        pool = None
        start = time.monotonic()
        for n in sorted(self.batch_buckets, reverse=True):
            for ctx in sorted(self.context_buckets, reverse=True):
                self._frame_step(n, ctx)  # warm-up: lazy inits, autotuning, allocator
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._frame_step(n, ctx)
                if pool is None:
                    pool = graph.pool()
                self.graphs[(n, ctx)] = graph
        steps_s = time.monotonic() - start
        pool = self._capture_packed(pool)
        if self.prefill_buckets:
            self._capture_prefill(pool)
            self.prefill_embeds.zero_()
        torch.cuda.synchronize(self.device)
        log.info(
            "talker: captured %d frame-step graphs in %.1f s, the prefill graphs in %.1f s",
            len(self.graphs),
            steps_s,
            time.monotonic() - start - steps_s,
        )
