"""ECAPA-TDNN speaker encoder of the Base models: 24 kHz waveform -> x-vector of the talker's width.

Parameter names match the checkpoint's `speaker_encoder.*` keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qtts.model.mel import log_mel_spectrogram
from qtts.request.errors import InvalidArgument


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """The `speaker_encoder_config` block of a Base model's config.json."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeakerEncoderConfig:
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
            if k in kw:
                kw[k] = tuple(int(x) for x in kw[k])
        cfg = cls(**kw)
        if not len(cfg.enc_channels) == len(cfg.enc_kernel_sizes) == len(cfg.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        if cfg.mel_dim != 128 or cfg.sample_rate != 24000:
            raise ValueError("the speaker encoder front-end is 128-bin log-mel at 24 kHz")
        return cfg


def _conv(cin: int, cout: int, kernel: int, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNNBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList([TDNNBlock(width, width, kernel, dilation) for _ in range(scale - 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        prev = None
        for i, part in enumerate(parts[1:]):
            prev = self.blocks[i](part if prev is None else part + prev)
            outs.append(prev)
        return torch.cat(outs, dim=1)


class SEBlock(nn.Module):
    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels, 1)
        self.conv2 = _conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * s


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se_channels: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNNBlock(cin, cout, 1, 1)
        self.res2net_block = Res2NetBlock(cout, scale, kernel, dilation)
        self.tdnn2 = TDNNBlock(cout, cout, 1, 1)
        self.se_block = SEBlock(cout, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (w * x).sum(dim=2)
    std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2).clamp(1e-12))
    return mean, std


class AttentiveStatsPool(nn.Module):
    """Attention-weighted mean and std over time, attention conditioned on global statistics."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        uniform = torch.full((x.shape[0], 1, t), 1.0 / t, dtype=x.dtype, device=x.device)
        mean, std = _weighted_stats(x, uniform)
        ctx = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        attn = F.softmax(self.conv(torch.tanh(self.tdnn(ctx))), dim=2)
        mean, std = _weighted_stats(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN over 128-bin log-mel; `embed(wav24k)` returns the x-vector [enc_dim]."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch, ks, dil = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [TDNNBlock(cfg.mel_dim, ch[0], ks[0], dil[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(
                SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dil[i])
            )
        self.blocks = nn.ModuleList(blocks)
        # Multi-layer feature aggregation over the SE-Res2Net outputs.
        self.mfa = TDNNBlock(sum(ch[1:-1]), ch[-1], ks[-1], dil[-1])
        self.asp = AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim, 1)

    @classmethod
    def from_config(cls, speaker_encoder_config: dict[str, Any]) -> SpeakerEncoder:
        return cls(SpeakerEncoderConfig.from_dict(speaker_encoder_config))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mel [B, frames, mel_dim] -> x-vectors [B, enc_dim]."""
        x = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    @torch.inference_mode()
    def embed(self, wav24k: torch.Tensor) -> torch.Tensor:
        """Mono 24 kHz waveform [N] (float) -> x-vector [enc_dim] in float32."""
        if wav24k.dim() != 1:
            raise ValueError(f"expected a mono waveform [N], got {tuple(wav24k.shape)}")
        if wav24k.shape[0] <= 512:
            raise InvalidArgument("reference audio is too short for a speaker embedding")
        return self.embed_batch(wav24k.unsqueeze(0))[0]

    @torch.inference_mode()
    def embed_batch(self, wavs24k: torch.Tensor) -> torch.Tensor:
        """Equal-length mono 24 kHz waveforms [B, N] -> x-vectors [B, enc_dim] in float32, each
        the x-vector `embed` gives its waveform (no padding: the statistics pool over all of N)."""
        if wavs24k.dim() != 2:
            raise ValueError(f"expected waveforms [B, N], got {tuple(wavs24k.shape)}")
        if wavs24k.shape[1] <= 512:
            raise InvalidArgument("reference audio is too short for a speaker embedding")
        weight = self.fc.weight
        mels = log_mel_spectrogram(wavs24k.float().cpu()).to(device=weight.device, dtype=weight.dtype)
        return self(mels).float()
