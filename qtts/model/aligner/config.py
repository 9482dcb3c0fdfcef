"""Qwen3-ForcedAligner snapshot config: the audio encoder, the text decoder and the timestamp head.

A snapshot is a Hugging Face `Qwen/Qwen3-ForcedAligner-0.6B` folder: `config.json` (`model_type`
`qwen3_asr`, `thinker_config.model_type` `qwen3_forced_aligner`), `model.safetensors`
(`thinker.audio_tower.*`, `thinker.model.*`, `thinker.lm_head.weight`), the tokenizer files and
`preprocessor_config.json` (a Whisper feature extractor, 128 mel bins at 16 kHz). For
`--load-format dummy` the name of a shipped config under `configs/` is enough.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtts import resources
from qtts.model.snapshot import SnapshotError

SHIPPED_CONFIG = "qwen3-forcedaligner-0.6b"
SAMPLE_RATE_HZ = 16000
TIMESTAMP_TOKEN = "<timestamp>"
AUDIO_START_TOKEN = "<|audio_start|>"
AUDIO_END_TOKEN = "<|audio_end|>"
AUDIO_PAD_TOKEN = "<|audio_pad|>"


@dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    output_dim: int
    downsample_hidden_size: int
    n_window: int
    n_window_infer: int
    max_source_positions: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioEncoderConfig:
        # Defaults of the official Qwen3ASRAudioEncoderConfig, for keys a config.json leaves out.
        return cls(
            num_mel_bins=int(d.get("num_mel_bins", 128)),
            d_model=int(d.get("d_model", 1280)),
            encoder_layers=int(d.get("encoder_layers", 32)),
            encoder_attention_heads=int(d.get("encoder_attention_heads", 20)),
            encoder_ffn_dim=int(d.get("encoder_ffn_dim", 5120)),
            output_dim=int(d.get("output_dim", 3584)),
            downsample_hidden_size=int(d.get("downsample_hidden_size", 480)),
            n_window=int(d.get("n_window", 100)),
            n_window_infer=int(d.get("n_window_infer", 400)),
            max_source_positions=int(d.get("max_source_positions", 1500)),
        )


@dataclass(frozen=True)
class TextDecoderConfig:
    """The fields `qtts.model.layers` reads (same names as the talker's `DecoderConfig`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextDecoderConfig:
        heads = int(d.get("num_attention_heads", 32))
        return cls(
            vocab_size=int(d.get("vocab_size", 151936)),
            hidden_size=int(d.get("hidden_size", 4096)),
            intermediate_size=int(d.get("intermediate_size", 22016)),
            num_layers=int(d.get("num_hidden_layers", 32)),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim", 128)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 5000000.0)),
            attention_bias=bool(d.get("attention_bias", False)),
        )


@dataclass(frozen=True)
class AlignerConfig:
    audio: AudioEncoderConfig
    text: TextDecoderConfig
    classify_num: int
    audio_token_id: int
    timestamp_token_id: int
    timestamp_segment_ms: float
    support_languages: tuple[str, ...]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AlignerConfig:
        thinker = raw["thinker_config"]
        return cls(
            audio=AudioEncoderConfig.from_dict(thinker.get("audio_config") or {}),
            text=TextDecoderConfig.from_dict(thinker.get("text_config") or {}),
            classify_num=int(thinker["classify_num"]),
            audio_token_id=int(thinker.get("audio_token_id", 151646)),
            timestamp_token_id=int(raw["timestamp_token_id"]),
            timestamp_segment_ms=float(raw["timestamp_segment_time"]),
            support_languages=tuple(str(x).lower() for x in raw.get("support_languages") or ()),
        )


@dataclass(frozen=True)
class AlignerSnapshot:
    folder: Path
    name: str
    config: AlignerConfig
    load_format: str  # "safetensors" | "dummy"

    @property
    def has_tokenizer(self) -> bool:
        return all((self.folder / f).is_file() for f in ("vocab.json", "merges.txt", "tokenizer_config.json"))


def open_aligner_snapshot(path_or_id: str | Path, load_format: str = "auto") -> AlignerSnapshot:
    """Find and validate a forced-aligner snapshot; raises `SnapshotError` naming what is wrong."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise SnapshotError(f"load_format must be auto, safetensors or dummy, got {load_format!r}")
    path_or_id = str(path_or_id)
    p = Path(path_or_id).expanduser()
    if p.is_dir():
        folder = p
    elif load_format == "dummy" and (resources.CONFIGS_DIR / path_or_id / "config.json").is_file():
        folder = resources.CONFIGS_DIR / path_or_id
    elif path_or_id.count("/") == 1 and not path_or_id.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(repo_id=path_or_id))
        except Exception as e:  # offline, unknown repo, auth
            raise SnapshotError(
                f"{path_or_id}: no such local folder and the hub download failed ({e})"
            ) from e
    else:
        raise SnapshotError(
            f"{path_or_id}: no such folder, and not a hub id (owner/name); shipped config for "
            f"--load-format dummy: {SHIPPED_CONFIG}"
        )
    cfg_path = folder / "config.json"
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{cfg_path}: unreadable config.json ({e})") from e
    thinker_type = (raw.get("thinker_config") or {}).get("model_type")
    if raw.get("model_type") != "qwen3_asr" or thinker_type != "qwen3_forced_aligner":
        raise SnapshotError(
            f"{folder}: not a Qwen3-ForcedAligner snapshot (model_type {raw.get('model_type')!r}, "
            f"thinker_config.model_type {thinker_type!r}; expected 'qwen3_asr' and 'qwen3_forced_aligner')"
        )
    try:
        config = AlignerConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{cfg_path}: malformed forced-aligner config ({type(e).__name__}: {e})") from e
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    snap = AlignerSnapshot(folder=folder, name=folder.name.lower(), config=config, load_format=fmt)
    if fmt == "safetensors":
        missing = [f for f in ("model.safetensors",) if not (folder / f).is_file()]
        missing += [] if snap.has_tokenizer else ["tokenizer files"]
        if missing:
            raise SnapshotError(f"{folder}: incomplete forced-aligner snapshot, missing {', '.join(missing)}")
    return snap
