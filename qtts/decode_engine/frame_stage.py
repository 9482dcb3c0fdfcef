"""The frame-rate part of a decode step: RVQ dequant, pre-conv input and the sliding-window
transformer over each stream's ring KV window in the `SlotPool`.

Its output, [B, n, latent] (time-major), feeds a conv stack (`conv_stack` or `conv_stack_cl`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtts.decode_engine.slots import SlotPool
from qtts.model.codec_decoder import CodecDecoder, SlidingAttention
from qtts.model.layers import RMSNorm


class FrameStage:
    """RVQ table lookup and the 8-layer transformer of `model`, state read from and written to `pool`.

    `reference` is the fp32 decoder: the folded RVQ table and the RoPE frequencies come from it (a
    bf16 copy would round the frequencies, and the error grows with the distance between positions)."""

    def __init__(self, model: CodecDecoder, reference: CodecDecoder, pool: SlotPool, dtype: torch.dtype):
        self.model = model
        self.pool = pool
        self.cfg = model.cfg
        self.window = model.cfg.sliding_window
        self.device = model.device
        self.rvq_table, self.rvq_offsets = self._fold_rvq(reference, dtype)
        self.inv_freq = reference.pre_transformer.inv_freq.detach().float().clone()
        # One GEMM for q, k and v and one for gate and up per layer (fewer launches per step: a
        # batch-1 step is launch-bound, and most of its kernels are this transformer's).
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._gate_up: list[torch.Tensor] = []
        with torch.no_grad():
            for layer in model.pre_transformer.layers:
                a = layer.self_attn
                projs = (a.q_proj, a.k_proj, a.v_proj)
                bias = None if a.q_proj.bias is None else torch.cat([m.bias for m in projs]).detach()
                self._qkv.append((torch.cat([m.weight for m in projs]).detach(), bias))
                mlp = layer.mlp
                self._gate_up.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach())

    def _fold_rvq(self, decoder: CodecDecoder, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One table [Q * size, codebook_dim]: each codebook vector already through its group's
        1x1 output projection (linear, so projecting before the sum equals projecting after)."""
        tables = []
        with torch.no_grad():
            for group in (decoder.quantizer.rvq_first, decoder.quantizer.rvq_rest):
                proj = group.output_proj.weight.detach().float()[:, :, 0]  # [io_dim, dim]
                for layer in group.vq.layers:
                    tables.append(layer._codebook.table().detach().float() @ proj.t())
        size = self.cfg.codebook_size
        offsets = torch.arange(len(tables), device=self.device, dtype=torch.long) * size
        return torch.cat(tables).to(device=self.device, dtype=dtype).contiguous(), offsets

    def run(self, codes: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Codes [B, n, Q] -> transformer output [B, n, latent] (time-major)."""
        # Out-of-range codes must never reach the gather: on CUDA that is a device assert that
        # poisons the whole process (the service validates codes; this is the last line).
        idx = codes.clamp(min=0, max=self.cfg.codebook_size - 1) + self.rvq_offsets
        h = F.embedding(idx, self.rvq_table).sum(dim=2).transpose(1, 2)  # [B, codebook_dim, n]
        conv = self.model.pre_conv
        buf = self.pool.buffers[conv.key]
        full = torch.cat([buf.index_select(0, slots), h], dim=2)
        buf.index_copy_(0, slots, full[:, :, full.shape[2] - conv.history :])
        return self.transformer(conv.conv(full).transpose(1, 2), slots, positions)

    def transformer(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, n, latent] -> [B, n, latent]; keys/values of the last `window` positions live in
        ring column `position % window` of each slot, so only the n new columns are written."""
        t = self.model.pre_transformer
        b, n, _ = x.shape
        w = self.window
        dev = x.device
        q_pos = positions.view(b, 1) + torch.arange(n, device=dev).view(1, n)  # [B, n]
        cols = torch.arange(w, device=dev).view(1, w)
        # Ring column j holds the one position p < positions with p % w == j and p >= positions - w.
        ring_pos = positions.view(b, 1) - w + torch.remainder(cols - positions.view(b, 1), w)
        k_pos = torch.cat([ring_pos, q_pos], dim=1)  # [B, w + n]
        qp, kp = q_pos.unsqueeze(2), k_pos.unsqueeze(1)
        allowed = ((kp >= 0) & (kp <= qp) & (kp > qp - w)).unsqueeze(1)  # [B, 1, n, w + n]
        freqs = q_pos.float().unsqueeze(-1) * self.inv_freq.view(1, 1, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(x.dtype).unsqueeze(2)  # [B, n, 1, D]: every head of a position
        sin = emb.sin().to(x.dtype).unsqueeze(2)
        write_rows = slots.view(b, 1).expand(b, n)
        write_cols = torch.remainder(q_pos, w)
        h = t.input_proj(x)
        for i, layer in enumerate(t.layers):
            x_in = _rms_norm(layer.input_layernorm, h)
            attn = self._attention(i, layer.self_attn, x_in, cos, sin, allowed, slots, write_rows, write_cols)
            h = h + layer.self_attn_layer_scale(attn)
            gate, up = F.linear(_rms_norm(layer.post_attention_layernorm, h), self._gate_up[i]).chunk(
                2, dim=-1
            )
            h = h + layer.mlp_layer_scale(layer.mlp.down_proj(F.silu(gate) * up))
        return t.output_proj(_rms_norm(t.norm, h))

    def _attention(
        self,
        i: int,
        a: SlidingAttention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        slots: torch.Tensor,
        write_rows: torch.Tensor,
        write_cols: torch.Tensor,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        qd, kd = a.heads * a.head_dim, a.kv_heads * a.head_dim
        qkv = F.linear(x, *self._qkv[i])
        # RoPE on the query and key heads together (one set of elementwise kernels).
        qk = qkv[..., : qd + kd].reshape(b, n, a.heads + a.kv_heads, a.head_dim)
        qk = qk * cos + _rotate_half(qk) * sin
        q = qk[:, :, : a.heads].transpose(1, 2)
        k = qk[:, :, a.heads :].transpose(1, 2)
        v = qkv[..., qd + kd :].reshape(b, n, a.kv_heads, a.head_dim).transpose(1, 2)
        k_buf, v_buf = self.pool.buffers[a.key + "k"], self.pool.buffers[a.key + "v"]
        k_all = torch.cat([k_buf.index_select(0, slots), k], dim=2)  # [B, kv, w + n, D]
        v_all = torch.cat([v_buf.index_select(0, slots), v], dim=2)
        k_buf[write_rows, :, write_cols] = k.transpose(1, 2)
        v_buf[write_rows, :, write_cols] = v.transpose(1, 2)
        # A plain matmul-softmax-matmul: at most window + n keys, and the softmax in fp32.
        rep = a.heads // a.kv_heads
        qg = q.reshape(b, a.kv_heads, rep * n, a.head_dim)
        scores = torch.matmul(qg, k_all.transpose(2, 3)).float() * (a.head_dim**-0.5)
        scores = scores.view(b, a.kv_heads, rep, n, -1).masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v_all.dtype).view(b, a.kv_heads, rep * n, -1)
        out = torch.matmul(probs, v_all).view(b, a.heads, n, a.head_dim)
        return a.o_proj(out.transpose(1, 2).reshape(b, n, a.heads * a.head_dim))


def _rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as one fused op (statistics in float32, like the module)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
