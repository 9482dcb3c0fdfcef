"""Settings of the Qwen3-TTS-12Hz speech tokenizer: its config.json and the decoder's block."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
