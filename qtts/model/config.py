"""Parsed `config.json` / `generation_config.json` of a Qwen3-TTS-12Hz snapshot.

Everything (dimensions, codec ids, languages, speakers) is read from the JSON: the class defaults
in the official configuration code are stale, the JSON of the checkpoint wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtts.request.model_variants import supports_instructions

MODEL_TYPES = ("base", "custom_voice", "voice_design")


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of one Qwen3 decoder stack (the talker's or the code predictor's)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecoderConfig:
        rope = d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default' is implemented)")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not used by Qwen3-TTS and not implemented")
        num_heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            attention_bias=bool(d.get("attention_bias", False)),
        )

    def num_parameters(self) -> int:
        """Parameters of the layers and the final norm (no embeddings or heads)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim
        if self.attention_bias:
            attn += q + 2 * kv + h
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attn + mlp + 2 * h) + h


@dataclass(frozen=True)
class PredictorConfig:
    """The per-frame code predictor (codebooks 1..15)."""

    decoder: DecoderConfig
    vocab_size: int  # 2048: one codebook
    num_code_groups: int  # 16

    @classmethod
    def from_dict(cls, d: dict[str, Any], num_code_groups: int) -> PredictorConfig:
        return cls(
            decoder=DecoderConfig.from_dict(d),
            vocab_size=int(d["vocab_size"]),
            num_code_groups=int(d.get("num_code_groups", num_code_groups)),
        )


@dataclass(frozen=True)
class TalkerModelConfig:
    """The talker LM: decoder shape, vocabularies and the codec control ids."""

    decoder: DecoderConfig
    predictor: PredictorConfig
    vocab_size: int  # codec vocabulary, 3072
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    language_ids: dict[str, int] = field(default_factory=dict)
    speaker_ids: dict[str, int] = field(default_factory=dict)
    speaker_dialects: dict[str, str | bool] = field(default_factory=dict)
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TalkerModelConfig:
        groups = int(d["num_code_groups"])
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")
        return cls(
            decoder=DecoderConfig.from_dict(d),
            predictor=PredictorConfig.from_dict(d["code_predictor_config"], groups),
            vocab_size=int(d["vocab_size"]),
            text_vocab_size=int(d["text_vocab_size"]),
            text_hidden_size=int(d["text_hidden_size"]),
            num_code_groups=groups,
            codec_eos_id=int(d["codec_eos_token_id"]),
            codec_pad_id=int(d["codec_pad_id"]),
            codec_bos_id=int(d["codec_bos_id"]),
            codec_think_id=int(d["codec_think_id"]),
            codec_nothink_id=int(d["codec_nothink_id"]),
            codec_think_bos_id=int(d["codec_think_bos_id"]),
            codec_think_eos_id=int(d["codec_think_eos_id"]),
            language_ids={str(k).lower(): int(v) for k, v in (d.get("codec_language_id") or {}).items()},
            speaker_ids={str(k).lower(): int(v) for k, v in (d.get("spk_id") or {}).items()},
            speaker_dialects={str(k).lower(): v for k, v in (d.get("spk_is_dialect") or {}).items()},
            hidden_act=act,
        )

    @property
    def suppressed_ids(self) -> list[int]:
        """Codebook-0 ids never sampled: the top 1024 of the codec vocabulary except EOS."""
        return [i for i in range(self.vocab_size - 1024, self.vocab_size) if i != self.codec_eos_id]

    @property
    def codebook_size(self) -> int:
        return self.predictor.vocab_size


@dataclass(frozen=True)
class ModelConfig:
    """The whole `config.json` of a Qwen3-TTS snapshot."""

    raw: dict[str, Any]
    talker: TalkerModelConfig
    speaker_encoder: dict[str, Any]
    tts_model_type: str
    tts_model_size: str
    tokenizer_type: str | None
    im_start_id: int
    im_end_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        return cls(
            raw=d,
            talker=TalkerModelConfig.from_dict(d["talker_config"]),
            speaker_encoder=dict(d.get("speaker_encoder_config") or {}),
            tts_model_type=str(d["tts_model_type"]),
            tts_model_size=str(d.get("tts_model_size") or ""),
            tokenizer_type=d.get("tokenizer_type"),
            im_start_id=int(d.get("im_start_token_id", 151644)),
            im_end_id=int(d.get("im_end_token_id", 151645)),
            tts_pad_id=int(d.get("tts_pad_token_id", 151671)),
            tts_bos_id=int(d.get("tts_bos_token_id", 151672)),
            tts_eos_id=int(d.get("tts_eos_token_id", 151673)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def languages(self) -> dict[str, int]:
        """Selectable languages (dialect entries are chosen through speakers, not by name)."""
        return {k: v for k, v in self.talker.language_ids.items() if "dialect" not in k}

    @property
    def speaker_encoder_sample_rate(self) -> int:
        return int(self.speaker_encoder.get("sample_rate", 24000))

    @property
    def supports_instruct(self) -> bool:
        """The official wrapper drops the instruct of 0.6B CustomVoice (`tts_model_size in "0b6"`).
        (The prompt builder asks this of CustomVoice only; a voice-clone prompt never has one.)"""
        return self.tts_model_type != "custom_voice" or supports_instructions(
            self.tts_model_type, self.tts_model_size
        )


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded snapshot serves (see docs/interfaces.md)."""

    model_type: str
    model_size: str
    name: str
    speakers: dict[str, int]
    languages: dict[str, int]
    num_codebooks: int = 16
    codebook_size: int = 2048
    sample_rate: int = 24000
    samples_per_frame: int = 1920


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """`generation_config.json` as a dict ({} when the file is absent)."""
    p = Path(path)
    if not p.is_file():
        return {}
    with open(p, encoding="utf-8") as f:
        return json.load(f)
