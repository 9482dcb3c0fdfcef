"""The frame step of the talker runner, written with static shapes for CUDA-graph capture.

`FrameStepMixin` is part of `ModelRunner`: talker decode of every row at its own position ->
codebook-0 logits -> penalty / masks / sampling -> the code predictor's 2-position start and 14
one-token steps -> 15 samples -> the next talker input. It reads and writes only the runner's
persistent buffers, so one replay of its graph is one frame for every active row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtts.engine import sampler
from qtts.engine.fused_layers import LayerWeights, attend, fused_decoder_layers, module_qkv
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
)

# The predictor's decode attention tile (see `_predictor_fused`): keys a block, pipeline stages,
# warps a program.
PREDICTOR_ATTENTION_BLOCK_N = 16
PREDICTOR_ATTENTION_STAGES = 1
PREDICTOR_ATTENTION_WARPS = 1


class FrameStepMixin:
    """The frame step of `ModelRunner` (its weights, caches, state and kernel choices)."""

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
            fused_qkv=self.fused_qkv and self.cfg.fused_qkv_max_rows,
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
        # At most 16 keys per row (the 2-token start, then 14 steps): one block of 16, one pipeline
        # stage (a single block has nothing to prefetch) and one warp a program. Each program is a
        # few dependent loads and two tiny dots, so the call is latency-bound: the smaller the
        # program, the more of the 8,192 programs of batch 1,024 an SM holds at once. H100, keys
        # 0..8 (benchmarks/decode_attention.py): 48.4 us a call at batch 1,024 with a block of 32
        # and 4 warps, 23.5 us with 16 and 1 (256: 11.4 -> 6.4 us); the frame step has 75 calls.
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
            block_n=PREDICTOR_ATTENTION_BLOCK_N,
            stages=PREDICTOR_ATTENTION_STAGES,
            warps=PREDICTOR_ATTENTION_WARPS,
            qkv_block_n=32,  # the fused q/k/v kernel (steps of few rows) keeps its measured tile
            fused_qkv=self.fused_qkv and self.cfg.fused_qkv_max_rows,
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
