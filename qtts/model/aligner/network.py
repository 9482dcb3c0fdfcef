"""Qwen3-ForcedAligner network: the audio encoder, the text decoder and the timestamp-class head.

One non-autoregressive forward pass: the audio encoder turns 16 kHz log-mel frames into one
embedding per 80 ms, those replace the `<|audio_pad|>` embeddings of the prompt, a causal Qwen3
decoder runs over the whole prompt once, and the head classifies every position into one of
`classify_num` timestamps (`timestamp_segment_time` ms apart); only the `<timestamp>` positions
are read. Attribute names match the checkpoint under its `thinker.` prefix.

Numerics follow the official `Qwen3ASRThinkerForConditionalGeneration` as it runs by default (the
SDPA attention path): the encoder convolves each 2 * n_window-frame chunk on its own, adds the
sinusoid positions per chunk and then attends over all of one audio's frames (the windows of
`n_window_infer` frames only take effect under flash-attention-2, which the default path skips).
The decoder's multimodal RoPE has three identical position streams, i.e. plain 1-D RoPE.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from qtts.model.aligner.config import AlignerConfig, AudioEncoderConfig, TextDecoderConfig
from qtts.model.layers import MLP, RMSNorm, RotaryEmbedding, apply_rope


def encoder_output_length(mel_frames: int) -> int:
    """Audio embeddings for `mel_frames` frames (three stride-2 convolutions per 100-frame chunk)."""
    rest = mel_frames % 100
    feat = (rest - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (mel_frames // 100) * 13


def _conv_length(n: int) -> int:
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


class _EncoderAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.num_heads = cfg.encoder_attention_heads
        self.head_dim = cfg.d_model // cfg.encoder_attention_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = (
            p(x).view(s, self.num_heads, self.head_dim).transpose(0, 1)[None]
            for p in (
                self.q_proj,
                self.k_proj,
                self.v_proj,
            )
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out[0].transpose(0, 1).reshape(s, -1))

    def forward_batched(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D] of several audios, right-padded; mask: [B, 1, 1, S], True on real keys."""
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = _EncoderAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [S, D] of one audio, or [B, S, D] of several with their key `mask` [B, 1, 1, S]."""
        h = self.self_attn_layer_norm(x)
        x = x + (self.self_attn(h) if mask is None else self.self_attn.forward_batched(h, mask))
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:
            lim = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-lim, lim)
        return x


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    step = np.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-step * torch.arange(channels // 2).float())
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * _conv_length(cfg.num_mel_bins), cfg.d_model, bias=False)
        self.layers = nn.ModuleList([_EncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.register_buffer(
            "positional_embedding", sinusoids(cfg.max_source_positions, cfg.d_model), persistent=False
        )

    def reset_buffers(self) -> None:
        """Recompute the sinusoid table (a meta-device build leaves it uninitialised)."""
        self.positional_embedding = sinusoids(self.cfg.max_source_positions, self.cfg.d_model).to(
            self.proj1.weight.device
        )

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel: [num_mel_bins, frames] of one audio -> [encoder_output_length(frames), output_dim]."""
        window = self.cfg.n_window * 2
        frames = mel.shape[1]
        lengths = [window] * (frames // window) + ([frames % window] if frames % window else [])
        chunks = mel.T.split(lengths, dim=0)
        padded = nn.utils.rnn.pad_sequence(chunks, batch_first=True).transpose(1, 2)[:, None]
        h = F.gelu(self.conv2d1(padded))
        h = F.gelu(self.conv2d2(h))
        h = F.gelu(self.conv2d3(h))
        b, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
        h = h + self.positional_embedding[:t].to(h.dtype)[None]
        keep = torch.zeros(b, t, dtype=torch.bool, device=h.device)
        for i, n in enumerate(lengths):
            keep[i, : encoder_output_length(n)] = True
        x = h[keep]
        for layer in self.layers:
            x = layer(x)
        x = self.ln_post(x)
        return self.proj2(F.gelu(self.proj1(x)))

    def forward_padded(
        self, chunks: torch.Tensor, conv_lens: torch.Tensor, tok_index: torch.Tensor, key_mask: torch.Tensor
    ) -> torch.Tensor:
        """Several audios in fixed shapes (no data-dependent shape: CUDA graphs can capture it).

        chunks: [N, num_mel_bins, 2 * n_window] mel chunks, zero-padded; conv_lens: [N, 3] how many
        outputs of each convolution are kept (the rest zeroed, as the convolution's own zero padding
        would see them for a chunk that `forward` does not pad); tok_index: [B, A] the flat index
        (chunk * tokens per chunk + token) of each audio's embeddings, right-padded; key_mask:
        [B, A], True where attention may look. Returns [B, A, output_dim]."""
        h = chunks[:, None]
        for i, conv in enumerate((self.conv2d1, self.conv2d2, self.conv2d3)):
            h = F.gelu(conv(h))
            keep = torch.arange(h.shape[-1], device=h.device)[None] < conv_lens[:, i : i + 1]
            h = h * keep[:, None, None, :].to(h.dtype)
        n, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(n, t, c * f))
        h = h + self.positional_embedding[:t].to(h.dtype)[None]
        b, a = tok_index.shape
        x = h.reshape(n * t, -1)[tok_index.reshape(-1)].view(b, a, -1)
        mask = key_mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        x = self.ln_post(x)
        return self.proj2(F.gelu(self.proj1(x)))


class _DecoderAttention(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.self_attn = _DecoderAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextDecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([_DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, H] embeddings of right-padded prompts (padding sits after every real token, so
        the causal mask alone keeps it out of sight) -> final-normed hidden states."""
        t = x.shape[1]
        positions = torch.arange(t, device=x.device)[None].expand(x.shape[0], t)
        cos, sin = self.rotary(positions, x.dtype)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class AlignerNet(nn.Module):
    """`thinker.*` of a Qwen3-ForcedAligner checkpoint."""

    def __init__(self, cfg: AlignerConfig):
        super().__init__()
        self.cfg = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextDecoder(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)

    def forward(self, input_ids: torch.Tensor, mels: list[torch.Tensor]) -> torch.Tensor:
        """input_ids: [B, T] right-padded prompts, each with as many audio tokens as its audio
        yields; mels: one [num_mel_bins, frames] per row -> timestamp-class logits [B, T, classify_num]."""
        embeds = self.model.embed_tokens(input_ids)
        audio = torch.cat([self.audio_tower(m.to(embeds.dtype)) for m in mels], dim=0)
        slots = input_ids == self.cfg.audio_token_id
        if int(slots.sum()) != audio.shape[0]:
            raise ValueError(
                f"{int(slots.sum())} audio tokens in the prompts but {audio.shape[0]} audio embeddings"
            )
        embeds = embeds.masked_scatter(slots[..., None], audio.to(embeds.dtype))
        return self.lm_head(self.model(embeds))

    def forward_padded(
        self,
        input_ids: torch.Tensor,
        chunks: torch.Tensor,
        conv_lens: torch.Tensor,
        tok_index: torch.Tensor,
        key_mask: torch.Tensor,
        audio_at: torch.Tensor,
        is_audio: torch.Tensor,
    ) -> torch.Tensor:
        """The batch in fixed shapes (see `AudioEncoder.forward_padded`); audio_at: [B, T] the flat
        index (row * A + embedding) of the audio embedding at each audio slot, is_audio: [B, T].
        Returns the timestamp class of every position, [B, T] (int64)."""
        embeds = self.model.embed_tokens(input_ids)
        audio = self.audio_tower.forward_padded(chunks.to(embeds.dtype), conv_lens, tok_index, key_mask)
        audio = audio.reshape(-1, audio.shape[-1])[audio_at.reshape(-1)].view(*input_ids.shape, -1)
        embeds = torch.where(is_audio[..., None], audio.to(embeds.dtype), embeds)
        return self.lm_head(self.model(embeds)).argmax(dim=-1)
