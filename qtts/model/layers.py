"""Qwen3 decoder layers written for serving: explicit KV-cache tensors, per-row positions.

The caller owns the cache: `KVCache` holds one key and one value tensor per layer, shaped
`[slots, kv_heads, capacity, head_dim]`. A forward call names the cache rows it uses
(`slots`, one per batch row) and the position of every input token (`positions`, `[B, T]`).
A token at position p is written into cache column p of its row and attends to columns
`0..p` of that row only, so a row never sees another row's cache, nor columns beyond its own
position (right padding of a ragged prefill writes to columns that the row's later tokens
overwrite before they can be attended to). No shape depends on data, which keeps the door open
for static slots and CUDA graphs.

Numerics follow the official Qwen3-TTS code: RMSNorm in float32, q/k RMSNorm per head before RoPE,
RoPE tables in float32 (the talker's multimodal RoPE has three identical position streams, which is
plain 1-D RoPE), softmax attention with scale `head_dim ** -0.5`, SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qtts.model.config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for integer positions (computed in float32, cast to the activation dtype)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float().to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


@dataclass
class KVCache:
    """Per-layer key/value tensors `[slots, kv_heads, capacity, head_dim]`."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, cfg: DecoderConfig, slots: int, capacity: int, device: torch.device | str, dtype: torch.dtype
    ) -> KVCache:
        shape = (slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        return cls(
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)],
        )

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0]

    def grow(self, capacity: int) -> None:
        """Enlarge every row to `capacity` columns, keeping the contents."""
        if capacity <= self.capacity:
            return
        for lst in (self.keys, self.values):
            for i, t in enumerate(lst):
                new = t.new_zeros((t.shape[0], t.shape[1], capacity, t.shape[3]))
                new[:, :, : t.shape[2]] = t
                lst[i] = new


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        mask: torch.Tensor,
        span: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Scatter the new keys/values into their rows at their positions.
        rows = slots[:, None].expand(b, t)
        k_cache[rows, :, positions] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows, :, positions] = v.transpose(1, 2).to(v_cache.dtype)
        keys = k_cache[slots, :, :span].to(q.dtype)
        values = v_cache[slots, :, :span].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask[:, None],
            scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, slots, k_cache, v_cache, mask, span):
        x = x + self.self_attn(
            self.input_layernorm(x), cos, sin, positions, slots, k_cache, v_cache, mask, span
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm. Attribute names match the checkpoint (`layers.N.*`, `norm`)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        span: int | None = None,
    ) -> torch.Tensor:
        """x: [B, T, H] input embeddings; positions: [B, T] (long); slots: [B] cache rows;
        `span` = max(positions) + 1 when the caller knows it (saves a device sync).

        Returns the final-normed hidden states [B, T, H]. Writes keys/values of every input token.
        """
        if span is None:
            span = int(positions.max().item()) + 1
        if span > cache.capacity:
            raise ValueError(f"position {span - 1} beyond the KV cache capacity {cache.capacity}")
        cols = torch.arange(span, device=x.device)
        mask = cols[None, None, :] <= positions[:, :, None]  # [B, T, span]
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, slots, cache.keys[i], cache.values[i], mask, span)
        return self.norm(x)
