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
`prefill.py` (PrefillMixin: prompt chunks into KV).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from qtts.engine import sampler
from qtts.engine.fused_layers import (
    LayerWeights,
    attend,
    fast_out_mlp,
    fast_predictor_layer,
    fast_qkv,
    fuse_layer,
    fused_decoder_layers,
    module_qkv,
)
from qtts.engine.kv_slots import slots_for_budget
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
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import KVMove
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

# Columns of the packed per-slot integer / float state.
I_POS, I_FRAME, I_SEED, I_TOPK, I_PTOPK, I_GREEDY, I_PGREEDY, I_MINF, I_TLEN = range(9)
NUM_I = 9
F_TEMP, F_TOPP, F_REP, F_PTEMP, F_PTOPP = range(5)
NUM_F = 5


class ModelRunner(PrefillMixin):
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
        # Fused weights first: the KV sizing below measures the memory left after them.
        self.talker_weights = (
            [fuse_layer(layer) for layer in self.talker.model.layers] if self.fast_path else []
        )
        self.predictor_weights = (
            [fuse_layer(layer) for layer in self.predictor.model.layers] if self.fast_path else []
        )
        self._choose_kernels(config)
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
        self._pred_layer_fn = fast_predictor_layer
        skinny = self.fused_decode if config.skinny_matmul is None else config.skinny_matmul
        if skinny and not self.fused_decode:
            raise ValueError("skinny_matmul needs the fused decode kernels")
        self._linear = self._fused_kernels.linear if skinny else F.linear
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
            self._compile_layer_fns()

    def _compile_layer_fns(self) -> None:
        """torch.compile the fast path's per-layer functions and the sampler."""
        # Every batch bucket, predictor step and prefill width is its own variant: above the
        # default limit of 8, dynamo silently runs the rest uncompiled. Raise the limit for this
        # process.
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
        # Batch, positions and sequence length vary across buckets and predictor steps.
        self._qkv_fn = torch.compile(fast_qkv, dynamic=True)
        self._out_fn = torch.compile(fast_out_mlp, dynamic=True)
        self._sample = torch.compile(sampler.sample_rows, dynamic=True)
        self._c0_logits = torch.compile(sampler.codebook0_logits, dynamic=True)
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
        return 2 * d.num_layers * d.num_kv_heads * d.head_dim * torch.finfo(self.dtype).bits // 8

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
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(
            max(0, free - self.cfg.reserve_bytes - self.cfg.prefix_cache_bytes) * self.cfg.kv_memory_fraction
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
        self.k_cache = torch.zeros(shape, device=dev, dtype=dt)
        self.v_cache = torch.zeros(shape, device=dev, dtype=dt)
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

    # -- bookkeeping copies (eager, outside the graphs) ---------------------------------------
    def apply_moves(self, moves: Seq[KVMove]) -> None:
        if not moves:
            return
        for m in moves:
            n = m.num_positions
            if n > 0:
                self.k_cache[:, m.dst, :, :n] = self.k_cache[:, m.src, :, :n]
                self.v_cache[:, m.dst, :, :n] = self.v_cache[:, m.src, :, :n]
        src = torch.tensor([m.src for m in moves], device=self.device)
        dst = torch.tensor([m.dst for m in moves], device=self.device)
        for buf in (self.next_embed, self.trailing, self.seen, self.slot_ints, self.slot_floats):
            buf[dst] = buf[src]

    def load_prefixes(self, seqs: Seq[Sequence]) -> None:
        """Copy cached prompt-prefix KV into the slots of sequences admitted with a hit."""
        for seq in seqs:
            k, v = self.prefix_cache.get(seq.prefix_key)
            n = seq.num_prefilled
            self.k_cache[:, seq.slot, :, :n] = k[:, :, :n]
            self.v_cache[:, seq.slot, :, :n] = v[:, :, :n]

    def store_prefix(self, seq: Sequence) -> None:
        """Keep the slot's first `prefix_len` positions under the sequence's prefix key."""
        n = seq.prefix_len
        k = self.k_cache[:, seq.slot, :, :n].clone()
        v = self.v_cache[:, seq.slot, :, :n].clone()
        self.prefix_cache.put(seq.prefix_key, k, v)

    def start(self, seqs: Seq[Sequence]) -> None:
        """Load the decode state of sequences whose prompt is now in KV."""
        if not seqs:
            return
        ints, floats = [], []
        for seq in seqs:
            sp, pr = seq.sampling, seq.prompt
            n_trail = int(pr.trailing.shape[0]) if pr.trailing is not None else 0
            if n_trail > self.cfg.max_trailing:
                raise ValueError(
                    f"{n_trail} trailing text positions exceed max_trailing={self.cfg.max_trailing}"
                )
            ints.append(
                [
                    seq.num_prefill_positions,
                    0,
                    seq.seed,
                    sp.top_k,
                    sp.subtalker_top_k,
                    int(sp.greedy),
                    int(sp.predictor_greedy),
                    sp.min_new_tokens,
                    n_trail,
                ]
            )
            floats.append(
                [
                    sp.temperature,
                    sp.top_p,
                    sp.repetition_penalty,
                    sp.subtalker_temperature,
                    sp.subtalker_top_p,
                ]
            )
            slot = seq.slot
            self.next_embed[slot] = pr.embeds[-1].to(self.device, self.dtype)
            if n_trail:
                self.trailing[slot, :n_trail] = pr.trailing.to(self.device, self.dtype)
            self.trailing[slot, n_trail] = pr.pad_embed.reshape(-1).to(self.device, self.dtype)
        idx = torch.tensor([s.slot for s in seqs], device=self.device)
        self.slot_ints[idx] = torch.tensor(ints, dtype=torch.long).to(self.device)
        self.slot_floats[idx] = torch.tensor(floats, dtype=torch.float32).to(self.device)
        self.seen[idx] = False

    def append_trailing(self, slot: int, start: int, embeds: torch.Tensor, pad_embed: torch.Tensor) -> None:
        """Text that arrived for a running stream: trailing positions [start, start + k) of its
        slot, `tts_pad` after them, and the row's trailing length (eager copies between replays)."""
        end = start + int(embeds.shape[0])
        self.trailing[slot, start:end] = embeds.to(self.device, self.dtype)
        self.trailing[slot, end] = pad_embed.reshape(-1).to(self.device, self.dtype)
        self.slot_ints[slot, I_TLEN] = end

    # -- the frame step --------------------------------------------------------------------------
    def _talker_decode(self, n: int, ctx: int) -> torch.Tensor:
        """One token per row at its own position; returns final-normed hidden [n, H]."""
        if self.fused_decode:
            return self._talker_decode_fused(n)
        model = self.talker.model
        act = self.active[:n]
        pos = self.slot_ints[:n, I_POS]
        wpos = torch.where(act, pos, torch.full_like(pos, self.scratch))
        rows = self.rows[:n]
        cos, sin = model.rotary(pos[:, None], self.dtype)  # [n, 1, D]
        mask = (torch.arange(ctx, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        x = self.next_embed[:n][:, None]  # [n, 1, H]
        for i, layer in enumerate(model.layers):
            q, k, v = self._layer_qkv(i, layer, x, cos, sin, self.talker_weights, self.tdec)
            self.k_cache[i][rows, :, wpos] = k[:, :, 0].to(self.dtype)
            self.v_cache[i][rows, :, wpos] = v[:, :, 0].to(self.dtype)
            keys = self.k_cache[i, :n, :, :ctx]
            values = self.v_cache[i, :n, :, :ctx]
            out = self._talker_attention(q, keys, values, mask).transpose(1, 2).reshape(n, 1, -1)
            x = self._layer_out(i, layer, x, out, self.talker_weights, self.tdec)
        return self._final_norm(model.norm, x)[:, 0]

    def _talker_attention(self, q, keys, values, mask) -> torch.Tensor:
        """The PyTorch decode's talker attention (benchmarks/runner_variants.py swaps in its variant)."""
        return attend(q, keys, values, mask, self.talker_attention)

    def _talker_decode_fused(self, n: int) -> torch.Tensor:
        """`_talker_decode` with the fused kernels; attention spans each row's own positions."""
        model = self.talker.model
        act = self.active[:n]
        pos = self.slot_ints[:n, I_POS]
        wpos = torch.where(act, pos, torch.full_like(pos, self.scratch))
        apos = pos.clamp(max=self.max_len - 1)  # padding rows may carry any position
        cos, sin = model.rotary(pos, self.dtype)  # [n, D]
        return fused_decoder_layers(
            self._fused_kernels,
            self._linear,
            self.next_embed[:n],
            self.talker_weights,
            self.tdec,
            self.k_cache,
            self.v_cache,
            self.rows[:n],
            wpos,
            apos,
            cos,
            sin,
            model.norm,
        )

    def _predictor_fused(self, x: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """`_predictor_layers` with the fused kernels, the per-frame K/V in `pk_cache`/`pv_cache`."""
        t = x.shape[1]
        if t == 2:
            assert start == 0
            m = 2 * n
            rows, pos = self.pred_start_rows[:m], self.pred_start_pos[:m]
            cos, sin = self.pred_start_cos[:m], self.pred_start_sin[:m]
        else:
            m = n
            rows, pos = self.rows[:n], self.pred_step_pos[start, :n]
            cos, sin = self.pred_cos[0, start].expand(n, -1), self.pred_sin[0, start].expand(n, -1)
        # At most 16 keys per row (the 2-token start, then 14 steps): one block of 32, not the talker's 64.
        h = fused_decoder_layers(
            self._fused_kernels,
            self._linear,
            x.reshape(m, -1),
            self.predictor_weights,
            self.pdec,
            self.pk_cache,
            self.pv_cache,
            rows,
            pos,
            pos,
            cos,
            sin,
            self.predictor.model.norm,
            block_n=32,
        )
        return h.view(n, t, -1)

    def _layer_qkv(self, i: int, layer, x, cos, sin, weights: list[LayerWeights], dcfg):
        if not self.fast_path:
            return module_qkv(layer.self_attn, layer.input_layernorm(x), cos, sin)
        w = weights[i]
        return self._qkv_fn(
            x,
            w.ln1,
            w.w_qkv,
            w.b_qkv,
            w.q_norm,
            w.k_norm,
            cos,
            sin,
            dcfg.rms_norm_eps,
            dcfg.num_heads,
            dcfg.num_kv_heads,
        )

    def _layer_out(self, i: int, layer, x, attn, weights: list[LayerWeights], dcfg):
        if not self.fast_path:
            x = x + layer.self_attn.o_proj(attn)
            return x + layer.mlp(layer.post_attention_layernorm(x))
        w = weights[i]
        return self._out_fn(x, attn, w.w_o, w.b_o, w.ln2, w.w_gate_up, w.w_down, dcfg.rms_norm_eps)

    def _final_norm(self, norm, x):
        if not self.fast_path:
            return norm(x)
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)

    def _predictor_layers(self, x: torch.Tensor, start: int, n: int, carry: list) -> torch.Tensor:
        """Predictor decoder over positions [start, start + T) of its per-frame KV; x [n, T, Hp].
        On the fast path with matmul attention the KV is carried in `carry` (per layer), else it
        lives in `pk_cache`/`pv_cache`."""
        if self.fused_decode:
            return self._predictor_fused(x, start, n)
        model = self.predictor.model
        t = x.shape[1]
        cos, sin = self.pred_cos[:, start : start + t], self.pred_sin[:, start : start + t]
        mask = self.start_mask if t == 2 else None
        if self.fast_path and self.predictor_carry_kv and self.predictor_attention == "matmul":
            d = self.pdec
            for i in range(d.num_layers):
                if start == 0:
                    carry[i] = (self.pk_cache[i, :n, :, :0], self.pv_cache[i, :n, :, :0])
                w = self.predictor_weights[i]
                x, keys, values = self._pred_layer_fn(
                    x,
                    carry[i][0],
                    carry[i][1],
                    cos,
                    sin,
                    mask,
                    w.ln1,
                    w.w_qkv,
                    w.b_qkv,
                    w.q_norm,
                    w.k_norm,
                    w.w_o,
                    w.b_o,
                    w.ln2,
                    w.w_gate_up,
                    w.w_down,
                    d.rms_norm_eps,
                    d.num_heads,
                    d.num_kv_heads,
                )
                carry[i] = (keys, values)
            return self._final_norm(model.norm, x)
        for i, layer in enumerate(model.layers):
            q, k, v = self._layer_qkv(i, layer, x, cos, sin, self.predictor_weights, self.pdec)
            self.pk_cache[i, :n, :, start : start + t] = k.to(self.dtype)
            self.pv_cache[i, :n, :, start : start + t] = v.to(self.dtype)
            keys = self.pk_cache[i, :n, :, : start + t]
            values = self.pv_cache[i, :n, :, : start + t]
            out = attend(q, keys, values, mask, self.predictor_attention).transpose(1, 2).reshape(n, t, -1)
            x = self._layer_out(i, layer, x, out, self.predictor_weights, self.pdec)
        return self._final_norm(model.norm, x)

    def _frame_uniforms(self, n: int) -> torch.Tensor | None:
        """[n, 16] counter uniforms of this frame (None: the sampling kernel computes its own)."""
        if self._sampling_kernels is not None:
            return None
        ints = self.slot_ints[:n]
        return sampler.frame_uniforms(ints[:, I_SEED], ints[:, I_FRAME], self.num_codebooks)

    def _sample_codebook(self, logits: torch.Tensor, n: int, codebook: int, uniforms: torch.Tensor | None):
        """Codebook `codebook` of rows [0, n) from its logits, with the talker's sampling parameters
        for codebook 0 and the predictor's for the others."""
        ints, floats = self.slot_ints[:n], self.slot_floats[:n]
        if codebook == 0:
            temp, top_k, top_p, greedy = (
                floats[:, F_TEMP],
                ints[:, I_TOPK],
                floats[:, F_TOPP],
                ints[:, I_GREEDY],
            )
        else:
            temp, top_k, top_p, greedy = (
                floats[:, F_PTEMP],
                ints[:, I_PTOPK],
                floats[:, F_PTOPP],
                ints[:, I_PGREEDY],
            )
        if self._sampling_kernels is not None:
            return self._sampling_kernels.sample(
                logits, temp, top_k, top_p, greedy, ints[:, I_SEED], ints[:, I_FRAME], codebook
            )
        return self._sample(
            logits, temp, top_k, top_p, greedy.bool(), uniforms[:, codebook], self.cfg.max_candidates
        )

    def _codebook0(self, hidden: torch.Tensor, n: int, uniforms: torch.Tensor | None) -> torch.Tensor:
        """Codebook 0 of rows [0, n) from the talker's hidden state: head, repetition penalty,
        masks, sampling. The float32 casts happen inside the (compiled) functions, fused there."""
        ints, floats = self.slot_ints[:n], self.slot_floats[:n]
        logits = self._c0_logits(
            self._linear(hidden, self.talker.codec_head.weight),
            self.seen[:n],
            floats[:, F_REP],
            self.suppressed,
            self.eos_mask,
            ints[:, I_FRAME],
            ints[:, I_MINF],
        )
        return self._sample_codebook(logits, n, 0, uniforms)

    def _frame_step(self, n: int, ctx: int) -> None:
        """Produce one frame for rows [0, n): reads and writes only persistent buffers."""
        ints = self.slot_ints[:n]
        act = self.active[:n]
        frame = ints[:, I_FRAME]
        uniforms = self._frame_uniforms(n)

        hidden = self._talker_decode(n, ctx)
        c0 = self._codebook0(hidden, n, uniforms)
        # A broken row samples sampler.INVALID_ID (-1): looked up as id 0 here, so the batch goes
        # on; codes_out keeps the -1 and the engine fails that row alone.
        c0_safe = c0.clamp_min(0)

        pred = self.predictor
        c0_embed = self.talker.model.codec_embedding(c0_safe)
        x = self._project(torch.stack([hidden, c0_embed], dim=1))
        codes = [c0]
        embed_sum = c0_embed
        start = 0
        carry: list = [None] * self.pdec.num_layers
        for j in range(pred.num_steps):
            h = self._predictor_layers(x, start, n, carry)
            start += x.shape[1]
            head = pred.lm_head[j]
            code = self._sample_codebook(self._linear(h[:, -1], head.weight, head.bias), n, j + 1, uniforms)
            codes.append(code)
            e = pred.model.codec_embedding[j](code.clamp_min(0))
            embed_sum = embed_sum + e
            if j + 1 < pred.num_steps:
                x = self._project(e[:, None])

        trail_idx = torch.minimum(frame, ints[:, I_TLEN])
        next_embed = (
            embed_sum + self.trailing[:n].gather(1, trail_idx[:, None, None].expand(n, 1, self.hidden))[:, 0]
        )
        # Commit, masked by `active` so padding / prefilling / skipped rows keep their state.
        self.codes_out[:n] = torch.stack(codes, dim=1)
        self.next_embed[:n] = torch.where(act[:, None], next_embed.to(self.dtype), self.next_embed[:n])
        seen_c0 = self.seen[:n].gather(1, c0_safe[:, None])
        self.seen[:n].scatter_(1, c0_safe[:, None], seen_c0 | act[:, None])
        step = act.long()
        self.slot_ints[:n, I_POS] += step
        self.slot_ints[:n, I_FRAME] += step

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """The predictor's input projection (talker width -> predictor width) of x [n, T, H]."""
        proj = self.predictor.small_to_mtp_projection
        if not isinstance(proj, torch.nn.Linear):
            return proj(x)
        n, t, h = x.shape
        return self._linear(x.reshape(n * t, h), proj.weight, proj.bias).view(n, t, -1)

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
        if self.prefill_buckets:
            self._capture_prefill(pool)
            self.prefill_embeds.zero_()
        torch.cuda.synchronize(self.device)
