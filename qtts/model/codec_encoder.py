"""Speech-tokenizer encoder (reference audio -> codec frames): Mimi with its decoder half removed,
keeping the first 16 of its 32 quantizers and ceil(len / 1920) frames."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qtts.model.codec_decoder import SpeechTokenizerConfig, resolve_speech_tokenizer_dir


def build_mimi_encoder(encoder_config: dict[str, Any]) -> nn.Module:
    """transformers' MimiModel from the `encoder_config` block, decoder half dropped."""
    from transformers import MimiConfig, MimiModel

    model = MimiModel(MimiConfig(**encoder_config))
    model.upsample = None
    model.decoder_transformer = None
    model.decoder = None
    return model


def init_dummy_codebooks(mimi: nn.Module, seed: int = 0) -> None:
    """Random codebooks (Mimi initialises them empty, which would map every frame to code 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in mimi.named_buffers():
            if name.endswith("codebook.embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=gen))
            elif name.endswith("codebook.cluster_usage"):
                buf.copy_(torch.rand(buf.shape, generator=gen) + 0.5)
            elif name.endswith("codebook.initialized"):
                buf.fill_(1)


class CodecEncoder(nn.Module):
    """Encodes mono 24 kHz reference audio into codec frames [T, 16] for the ICL prompt and prefix."""

    def __init__(self, cfg: SpeechTokenizerConfig):
        super().__init__()
        self.cfg = cfg
        self.num_quantizers = cfg.encoder_valid_num_quantizers
        self.samples_per_frame = cfg.encode_downsample_rate
        self.model = build_mimi_encoder(cfg.encoder)

    @classmethod
    def load(
        cls,
        speech_tokenizer_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        load_format: str = "auto",
    ) -> CodecEncoder:
        """Load `encoder.*` strictly from a speech tokenizer folder (or a snapshot holding one).

        Codes are argmins over codebook distances, so run it in float32 to match the reference."""
        folder = resolve_speech_tokenizer_dir(speech_tokenizer_dir, load_format)
        cfg = SpeechTokenizerConfig.load(folder)
        if load_format == "dummy":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                enc = cls(cfg)
            init_dummy_codebooks(enc.model)
        else:
            enc = cls(cfg)
            from safetensors.torch import load_file

            weights = folder / "model.safetensors"
            if not weights.is_file():
                raise ValueError(f"{folder} has no model.safetensors")
            sd = {
                k[len("encoder.") :]: v
                for k, v in load_file(str(weights)).items()
                if k.startswith("encoder.")
            }
            enc.model.load_state_dict(sd, strict=True)
        return enc.to(device=device, dtype=dtype).eval()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def encode(self, wav24k: torch.Tensor) -> torch.Tensor:
        """Mono 24 kHz waveform [N] -> codes LongTensor[ceil(N / 1920), 16] (on the encoder's device)."""
        if wav24k.dim() != 1 or wav24k.shape[0] == 0:
            raise ValueError(f"expected a non-empty mono waveform [N], got {tuple(wav24k.shape)}")
        return self.encode_batch(wav24k.unsqueeze(0))[0]

    @torch.inference_mode()
    def encode_batch(self, wavs24k: torch.Tensor) -> torch.Tensor:
        """Equal-length mono 24 kHz waveforms [B, N] -> codes LongTensor[B, ceil(N / 1920), 16],
        each the codes `encode` gives its waveform. Clips of different lengths must not be padded
        to one: the downsampling pads the last partial frame by replication, so its codes change."""
        if wavs24k.dim() != 2 or wavs24k.shape[1] == 0:
            raise ValueError(f"expected non-empty waveforms [B, N], got {tuple(wavs24k.shape)}")
        dtype = next(self.model.parameters()).dtype
        x = wavs24k.to(device=self.device, dtype=dtype).unsqueeze(1)
        out = self.model.encode(x, num_quantizers=self.num_quantizers, return_dict=True)
        frames = math.ceil(wavs24k.shape[1] / self.samples_per_frame)
        return out.audio_codes[:, : self.num_quantizers, :frames].transpose(1, 2).long().contiguous()
