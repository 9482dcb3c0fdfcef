"""The layers of the speech-tokenizer decoder (`codec_decoder.CodecDecoder` assembles them).

Every layer is causal. Stateful layers read their history from the `StreamContext` cache (zeros for
a fresh stream, which is exactly the zero left padding of a full decode) and write back the history
they leave behind; rows of a batch may carry different numbers of valid frames (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qtts.model.codec_config import CodecDecoderConfig
from qtts.model.layers import RMSNorm

# ----------------------------------------------------------------------------------------------
# streaming helpers


@dataclass
class StreamContext:
    """Per-call bookkeeping: the cache being read/written and each row's valid new frames."""

    cache: dict[str, torch.Tensor]
    lengths: torch.Tensor  # LongTensor[B], valid new frames per row
    positions: torch.Tensor  # LongTensor[B], frames decoded before this call per row
    uniform: bool  # every row is valid over the whole padded length (fast slicing path)


def _take_history(full: torch.Tensor, valid: torch.Tensor, h: int, uniform: bool) -> torch.Tensor:
    """The last `h` steps before each row's valid end in `full` = cat(history, new) [B, C, h+L]."""
    if uniform:  # every row is valid to its end: no index tensor (and no host sync) needed
        return full[:, :, full.shape[2] - h :].contiguous()
    idx = valid.view(-1, 1, 1) + torch.arange(h, device=full.device).view(1, 1, h)
    return torch.gather(full, 2, idx.expand(full.shape[0], full.shape[1], h))


class CausalConv1d(nn.Module):
    """Stride-1 causal conv (left zero padding); the padding is the carried history when streaming."""

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, dilation=dilation, groups=groups)
        self.history = (kernel_size - 1) * dilation
        self.key = ""
        self.rate = 1  # time steps per codec frame at this layer

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        if self.history == 0:
            return self.conv(x)
        hist = ctx.cache[self.key]
        full = torch.cat([hist.to(x.dtype), x], dim=2)
        ctx.cache[self.key] = _take_history(full, ctx.lengths * self.rate, self.history, ctx.uniform)
        return self.conv(full)

    def empty_state(self, batch: int, device, dtype) -> dict[str, torch.Tensor]:
        if self.history == 0:
            return {}
        return {self.key: torch.zeros(batch, self.conv.in_channels, self.history, device=device, dtype=dtype)}


class CausalTransConv1d(nn.Module):
    """Transposed conv trimmed on the right (causal). Streaming carries the input frames whose
    output tails reach into the next call, and recomputes their overlap instead of storing tails."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride)
        self.stride = stride
        self.history = -(-kernel_size // stride) - 1
        self.key = ""
        self.rate = 1

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        n = x.shape[-1]
        if self.history == 0:
            return self.conv(x)[..., : n * self.stride]
        hist = ctx.cache[self.key]
        full = torch.cat([hist.to(x.dtype), x], dim=2)
        ctx.cache[self.key] = _take_history(full, ctx.lengths * self.rate, self.history, ctx.uniform)
        start = self.history * self.stride
        return self.conv(full)[..., start : start + n * self.stride]

    def empty_state(self, batch: int, device, dtype) -> dict[str, torch.Tensor]:
        if self.history == 0:
            return {}
        return {self.key: torch.zeros(batch, self.conv.in_channels, self.history, device=device, dtype=dtype)}


class SnakeBeta(nn.Module):
    """x + 1/exp(beta) * sin^2(x * exp(alpha)), per channel (log-scale parameters)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        h = self.dwconv(x, ctx).transpose(1, 2)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class SlidingAttention(nn.Module):
    """Causal self-attention over the last `window` positions; keys live in a fixed-size window
    cache (slot j of a row holds position pos - window + j), so states stack into one batch."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.key = ""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, ctx: StreamContext
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_all = torch.cat([ctx.cache[self.key + "k"].to(k.dtype), k], dim=2)
        v_all = torch.cat([ctx.cache[self.key + "v"].to(v.dtype), v], dim=2)
        ctx.cache[self.key + "k"] = _take_window(k_all, ctx.lengths, self.window, ctx.uniform)
        ctx.cache[self.key + "v"] = _take_window(v_all, ctx.lengths, self.window, ctx.uniform)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k_all = k_all.repeat_interleave(rep, dim=1)
            v_all = v_all.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))

    def empty_state(self, batch: int, device, dtype) -> dict[str, torch.Tensor]:
        shape = (batch, self.kv_heads, self.window, self.head_dim)
        return {
            self.key + "k": torch.zeros(shape, device=device, dtype=dtype),
            self.key + "v": torch.zeros(shape, device=device, dtype=dtype),
        }


def _take_window(full: torch.Tensor, valid: torch.Tensor, w: int, uniform: bool) -> torch.Tensor:
    """Keys/values [B, H, w+L, D] -> the w slots ending at each row's valid end."""
    if uniform:
        return full[:, :, full.shape[2] - w :].contiguous()
    b, h, _, d = full.shape
    idx = valid.view(-1, 1, 1, 1) + torch.arange(w, device=full.device).view(1, 1, w, 1)
    return torch.gather(full, 2, idx.expand(b, h, w, d))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.self_attn = SlidingAttention(cfg)
        self.mlp = DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask, ctx: StreamContext) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, ctx))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class FrameTransformer(nn.Module):
    """The 8-layer sliding-window transformer that runs at frame rate between pre-conv and upsampling."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        b, n, _ = x.shape
        w = self.cfg.sliding_window
        dev = x.device
        steps = torch.arange(n, device=dev)
        q_pos = ctx.positions.view(b, 1) + steps.view(1, n)  # [B, n]
        k_pos = torch.cat(
            [ctx.positions.view(b, 1) - w + torch.arange(w, device=dev).view(1, w), q_pos], dim=1
        )
        qp, kp = q_pos.unsqueeze(2), k_pos.unsqueeze(1)
        mask = ((kp >= 0) & (kp <= qp) & (kp > qp - w)).unsqueeze(1)  # [B, 1, n, w+n]
        freqs = q_pos.float().unsqueeze(-1) * self.inv_freq.float().view(1, 1, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(x.dtype).unsqueeze(1)
        sin = emb.sin().to(x.dtype).unsqueeze(1)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, ctx)
        return self.output_proj(self.norm(h))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        h = self.conv1(self.act1(x), ctx)
        return x + self.conv2(self.act2(h), ctx)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig, idx: int):
        super().__init__()
        cin = cfg.decoder_dim // 2**idx
        cout = cfg.decoder_dim // 2 ** (idx + 1)
        rate = cfg.upsample_rates[idx]
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalTransConv1d(cin, cout, 2 * rate, rate)]
            + [ResidualUnit(cout, d) for d in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        x = self.block[0](x)
        x = self.block[1](x, ctx)
        for unit in self.block[2:]:
            x = unit(x, ctx)
        return x


class Codebook(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = Codebook(dim, size)


class _VQStack(nn.Module):
    def __init__(self, n: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList([_VQ(dim, size) for _ in range(n)])


class RVQGroup(nn.Module):
    """One residual group (semantic or acoustic): sum of codebook vectors, then a 1x1 projection."""

    def __init__(self, n: int, dim: int, io_dim: int, size: int):
        super().__init__()
        self.vq = _VQStack(n, dim, size)
        # input_proj is the encoder-side projection; kept so the checkpoint loads strictly.
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, n] -> [B, io_dim, T]."""
        acc = None
        for i, layer in enumerate(self.vq.layers):
            e = F.embedding(codes[..., i], layer._codebook.table())
            acc = e if acc is None else acc + e
        return self.output_proj(acc.transpose(1, 2))


class SplitRVQ(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = RVQGroup(1, dim, cfg.codebook_dim, cfg.codebook_size)
        self.rvq_rest = RVQGroup(cfg.num_quantizers - 1, dim, cfg.codebook_dim, cfg.codebook_size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[..., :1]) + self.rvq_rest.decode(codes[..., 1:])
