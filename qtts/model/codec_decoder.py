"""Speech-tokenizer decoder of Qwen3-TTS-12Hz: 16 codebooks per 80 ms frame -> 24 kHz waveform.

Every layer is causal, so one code path serves both the full decode and the stateful incremental
decode: each stateful layer reads its history from a cache dict (zeros for a fresh stream, which is
exactly the zero left padding of the full decode) and writes back the history it leaves behind.
Rows of a batch may carry different numbers of valid frames (right-padded); causality keeps the
padding out of every valid output, and the histories are taken at each row's own valid length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qtts import resources
from qtts.model.layers import RMSNorm

_REPO_CONFIGS = resources.CONFIGS_DIR


@dataclass(frozen=True)
class CodecDecoderConfig:
    """The `decoder_config` block of a speech tokenizer's config.json."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    num_quantizers: int = 16
    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 72
    attention_bias: bool = False
    layer_scale_initial_scale: float = 0.01
    decoder_dim: int = 1536
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecDecoderConfig:
        names = cls.__dataclass_fields__.keys()
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("upsample_rates", "upsampling_ratios"):
            if k in kw:
                kw[k] = tuple(int(x) for x in kw[k])
        if "head_dim" not in d:
            kw["head_dim"] = int(d.get("hidden_size", cls.hidden_size)) // int(
                d.get("num_attention_heads", cls.num_attention_heads)
            )
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.num_quantizers < 2:
            raise ValueError("decoder needs at least 2 quantizers (1 semantic + acoustic)")
        if self.codebook_dim % 2:
            raise ValueError("codebook_dim must be even (the codebooks are codebook_dim // 2 wide)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.decoder_dim % (2 ** len(self.upsample_rates)):
            raise ValueError("decoder_dim must halve cleanly through every decoder block")

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    """A speech tokenizer's config.json: decoder settings, the raw Mimi encoder block, rates."""

    decoder: CodecDecoderConfig
    encoder: dict[str, Any] = field(default_factory=dict)
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920
    encode_downsample_rate: int = 1920

    @classmethod
    def load(cls, folder: Path) -> SpeechTokenizerConfig:
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read speech tokenizer config {path}: {e}") from e
        if raw.get("model_type") != "qwen3_tts_tokenizer_12hz":
            raise ValueError(
                f"{path} is not a Qwen3-TTS 12 Hz speech tokenizer (model_type={raw.get('model_type')!r})"
            )
        dec = CodecDecoderConfig.from_dict(raw.get("decoder_config", {}))
        cfg = cls(
            decoder=dec,
            encoder=dict(raw.get("encoder_config", {})),
            encoder_valid_num_quantizers=int(raw.get("encoder_valid_num_quantizers", 16)),
            input_sample_rate=int(raw.get("input_sample_rate", 24000)),
            output_sample_rate=int(raw.get("output_sample_rate", 24000)),
            decode_upsample_rate=int(raw.get("decode_upsample_rate", 1920)),
            encode_downsample_rate=int(raw.get("encode_downsample_rate", 1920)),
        )
        if dec.samples_per_frame != cfg.decode_upsample_rate:
            raise ValueError(
                f"{path}: decoder upsamples by {dec.samples_per_frame}, config says {cfg.decode_upsample_rate}"
            )
        return cfg


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


class CodecDecoder(nn.Module):
    """Codes [B, T, 16] -> waveform [B, T*1920] in [-1, 1]; parameter names match `decoder.*`."""

    def __init__(self, cfg: CodecDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.samples_per_frame = cfg.samples_per_frame
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = FrameTransformer(cfg)
        self.upsample = nn.ModuleList(
            [
                nn.ModuleList(
                    [CausalTransConv1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)]
                )
                for r in cfg.upsampling_ratios
            ]
        )
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
            + [DecoderBlock(cfg, i) for i in range(len(cfg.upsample_rates))]
            + [SnakeBeta(out_dim), CausalConv1d(out_dim, 1, 7)]
        )
        self._stateful = self._assign_keys_and_rates()

    def _assign_keys_and_rates(self) -> list[nn.Module]:
        """Name each stateful layer's cache entry and record its time resolution (steps per frame)."""
        stateful: list[nn.Module] = []
        rate = 1
        for name, mod in self.named_modules():
            if name.startswith("upsample.") and isinstance(mod, CausalTransConv1d):
                rate *= mod.stride
            elif name.startswith("decoder.") and isinstance(mod, CausalTransConv1d):
                rate *= mod.stride
            if isinstance(mod, CausalConv1d | CausalTransConv1d):
                mod.key = name
                # A transposed conv's history is taken from its input, before it upsamples.
                mod.rate = rate // mod.stride if isinstance(mod, CausalTransConv1d) else rate
                if mod.history:
                    stateful.append(mod)
            elif isinstance(mod, SlidingAttention):
                mod.key = name + "."
                stateful.append(mod)
        return stateful

    @property
    def device(self) -> torch.device:
        return self.pre_conv.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_conv.conv.weight.dtype

    def empty_cache(self, batch: int) -> dict[str, torch.Tensor]:
        """Fresh per-stream history (all zeros), batch-first tensors keyed by layer."""
        cache: dict[str, torch.Tensor] = {}
        for mod in self._stateful:
            cache.update(mod.empty_state(batch, self.device, self.dtype))
        return cache

    def forward_stream(
        self,
        codes: torch.Tensor,
        cache: dict[str, torch.Tensor],
        positions: torch.Tensor,
        lengths: torch.Tensor,
        uniform: bool | None = None,
    ) -> torch.Tensor:
        """Decode right-padded codes [B, L, Q] continuing from `cache` (updated in place).

        `positions[b]` frames were decoded before for row b; `lengths[b]` of the L frames are valid.
        Returns [B, L*spf]; samples past a row's valid length are garbage and must be dropped.
        `uniform` (every row valid over all L frames) may be passed to skip a host sync."""
        if codes.shape[-1] != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} codebooks, got {codes.shape[-1]}")
        if uniform is None:
            uniform = bool((lengths == codes.shape[1]).all())
        ctx = StreamContext(cache=cache, lengths=lengths, positions=positions, uniform=uniform)
        h = self.quantizer.decode(codes.clamp(min=0)).to(self.dtype)
        h = self.pre_conv(h, ctx)
        h = self.pre_transformer(h.transpose(1, 2), ctx).transpose(1, 2)
        for trans, block in self.upsample:
            h = block(trans(h, ctx), ctx)
        for layer in self.decoder:
            h = layer(h) if isinstance(layer, SnakeBeta) else layer(h, ctx)
        return h.clamp(min=-1.0, max=1.0).squeeze(1)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Full decode of codes [B, T, Q] (or [T, Q]) -> waveform [B, T*1920] (or [T*1920])."""
        squeeze = codes.dim() == 2
        if squeeze:
            codes = codes.unsqueeze(0)
        codes = codes.to(self.device)
        b, t, _ = codes.shape
        if t == 0:
            out = torch.zeros(b, 0, device=self.device, dtype=self.dtype)
        else:
            pos = torch.zeros(b, dtype=torch.long, device=self.device)
            lens = torch.full((b,), t, dtype=torch.long, device=self.device)
            out = self.forward_stream(codes, self.empty_cache(b), pos, lens, uniform=True)
        return out[0] if squeeze else out


# ----------------------------------------------------------------------------------------------
# loading


def resolve_speech_tokenizer_dir(path_or_id: str | Path, load_format: str = "auto") -> Path:
    """A snapshot folder, its speech_tokenizer/ folder, a hub id, or (dummy) a shipped config name."""
    p = Path(path_or_id)
    for cand in (p / "speech_tokenizer", p):
        if (cand / "config.json").is_file():
            try:
                if (
                    json.loads((cand / "config.json").read_text()).get("model_type")
                    == "qwen3_tts_tokenizer_12hz"
                ):
                    return cand
            except (OSError, json.JSONDecodeError):
                continue
    if load_format == "dummy":
        # Every variant shares the same codec, so any shipped config name maps to the one codec config.
        return _REPO_CONFIGS / "speech_tokenizer"
    if not p.exists() and "/" in str(path_or_id) and not str(path_or_id).startswith(("/", ".")):
        from huggingface_hub import snapshot_download

        try:
            local = Path(snapshot_download(str(path_or_id), allow_patterns=["speech_tokenizer/*"]))
        except Exception as e:  # offline, unknown repo, no access: all mean "cannot load this id"
            raise ValueError(
                f"{path_or_id} is not a local folder and could not be fetched from the hub: {e}"
            ) from e
        return resolve_speech_tokenizer_dir(local, "auto")
    raise ValueError(f"{path_or_id} holds no Qwen3-TTS 12 Hz speech tokenizer (speech_tokenizer/config.json)")


def init_dummy_weights(module: nn.Module, seed: int = 0) -> None:
    """Seeded random weights with realistic scales (dummy load format and tiny test checkpoints)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "cluster_usage":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif leaf == "embedding_sum":
                p.copy_(torch.randn(p.shape, generator=gen))
            elif leaf in ("alpha", "beta"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif leaf in ("scale", "gamma"):
                p.copy_(0.1 + 0.05 * torch.rand(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if leaf == "weight" else 0.0 * p)
            elif leaf == "bias":
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else p.numel()
                # Residual branches start small (as trained ones tend to be) so random weights do
                # not amplify float rounding by orders of magnitude through the 4 decoder blocks.
                gain = 0.2 if ".block." in name and (".conv1." in name or ".conv2." in name) else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(max(fan_in, 1)))
        for mod in module.modules():
            if isinstance(mod, CausalTransConv1d):
                # Make each transposed conv map a constant input to a constant output. Otherwise
                # the DC that SnakeBeta always adds comes out as a code-independent periodic
                # pattern that every random-weight waveform shares (real weights have none).
                w, r = mod.conv.weight, mod.stride
                if w.shape[-1] == 2 * r:
                    w[..., r:] = -w[..., :r]
                elif w.shape[-1] == r:
                    w[...] = w[..., :1]
        if isinstance(module, CodecDecoder):
            # Rescale the output conv so random weights give speech-like levels instead of a
            # clamped square wave (the clamp would hide most of the network in tests).
            codes = torch.randint(
                0, module.cfg.codebook_size, (1, 4, module.cfg.num_quantizers), generator=gen
            )
            last = module.decoder[-1].conv
            last.bias.zero_()
            module.decoder[-1].conv.weight.mul_(0.01)
            std = module.decode(codes).std().item()
            last.weight.mul_(0.25 / max(std, 1e-6))


def load_codec_decoder(
    path_or_id: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
) -> CodecDecoder:
    """Build the decoder from a speech tokenizer folder and load `decoder.*` strictly."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}")
    folder = resolve_speech_tokenizer_dir(path_or_id, load_format)
    cfg = SpeechTokenizerConfig.load(folder)
    model = CodecDecoder(cfg.decoder)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        from safetensors.torch import load_file

        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"{folder} has no model.safetensors")
        sd = {k[len("decoder.") :]: v for k, v in load_file(str(weights)).items() if k.startswith("decoder.")}
        model.load_state_dict(sd, strict=True)
    return model.to(device=device, dtype=dtype).eval()
