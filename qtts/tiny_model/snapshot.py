"""Tiny random Qwen3-TTS-12Hz snapshots in the real folder layout.

`build_tiny_snapshot(out_dir, model_type)` writes a 2-layer, narrow model with the REAL ids and
vocabulary sizes (text vocab 151936, codec vocab 3072, 16 codebooks of 2048, real codec control
ids, languages and preset speakers) and seeded random weights: `config.json` as plain nested dicts
(as the real checkpoints; the speaker-encoder config does not survive `save_pretrained`),
`generation_config.json`, `model.safetensors`, the tokenizer files (`qtts.tiny_model.tokenizer`),
`preprocessor_config.json` and `speech_tokenizer/` (`qtts.tiny_model.codec`). It needs neither
network nor `qwen-tts`, and the official `Qwen3TTSModel.from_pretrained(folder)` loads it.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch

from qtts.model.config import MODEL_TYPES, ModelConfig
from qtts.tiny_model import TINY_DEFAULT_LENGTH

log = logging.getLogger(__name__)

# Real ids (Qwen3-TTS-12Hz config.json).
LANGUAGE_IDS = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
SPEAKER_IDS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
SPEAKER_DIALECTS: dict[str, str | bool] = {
    "serena": False,
    "vivian": False,
    "uncle_fu": False,
    "ryan": False,
    "aiden": False,
    "ono_anna": False,
    "sohee": False,
    "eric": "sichuan_dialect",
    "dylan": "beijing_dialect",
}
CODEC_IDS = {
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
}
TEXT_IDS = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
}
GENERATION_CONFIG = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "max_new_tokens": 8192,
    **TINY_DEFAULT_LENGTH,
}
# Random weights with a larger spread than the usual 0.02, so greedy logits are well separated
# and implementations that differ only in float rounding pick the same codes.
TINY_INIT_STD = 0.2


def full_config(
    model_type: str,
    size: str,
    talker: dict[str, Any],
    predictor: dict[str, Any],
    speaker_encoder: dict[str, Any],
) -> dict[str, Any]:
    """A `config.json` dict in the layout of the real checkpoints.

    Long, kept in one piece: a config table, key by key as the real checkpoints have it."""
    custom = model_type == "custom_voice"
    talker_cfg = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 32768,
        "num_code_groups": 16,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
            "type": "default",
        },
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 3072,
        "text_vocab_size": 151936,
        **CODEC_IDS,
        "codec_language_id": dict(LANGUAGE_IDS),
        "spk_id": dict(SPEAKER_IDS) if custom else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if custom else {},
        **talker,
    }
    talker_cfg["code_predictor_config"] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 65536,
        "num_code_groups": 16,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 2048,
        **predictor,
    }
    cfg = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_size": size,
        "tts_model_type": model_type,
        **TEXT_IDS,
        "talker_config": talker_cfg,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.3",
    }
    if model_type == "base":
        cfg["speaker_encoder_config"] = {
            "mel_dim": 128,
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "sample_rate": 24000,
            **speaker_encoder,
        }
    return cfg


def tiny_config(model_type: str = "base") -> dict[str, Any]:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}")
    cfg = full_config(
        model_type,
        "tiny",
        talker={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "text_hidden_size": 32,
            "rope_scaling": {
                "interleaved": True,
                "mrope_section": [4, 2, 2],
                "rope_type": "default",
                "type": "default",
            },
        },
        # Narrower than the talker, so `small_to_mtp_projection` is a real Linear as in 1.7B.
        predictor={
            "hidden_size": 24,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
        },
        speaker_encoder={
            "enc_dim": 32,
            "enc_channels": [32, 32, 32, 32, 96],
            "enc_attention_channels": 16,
            "enc_res2net_scale": 4,
            "enc_se_channels": 16,
        },
    )
    return copy.deepcopy(cfg)


def _speaker_encoder_state(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    from qtts.model.dummy import init_dummy_weights
    from qtts.model.speaker_encoder import SpeakerEncoder

    enc = SpeakerEncoder.from_config(cfg["speaker_encoder_config"])
    init_dummy_weights(enc, seed=seed, std=0.1)
    return {f"speaker_encoder.{k}": v.contiguous() for k, v in enc.state_dict().items()}


def tiny_state_dict(cfg_dict: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    from qtts.model.bundle import build_modules
    from qtts.model.dummy import init_dummy_weights, materialize

    cfg = ModelConfig.from_dict(cfg_dict)
    talker, predictor = build_modules(cfg)
    talker = init_dummy_weights(materialize(talker, "cpu", torch.float32), seed=seed, std=TINY_INIT_STD)
    predictor = init_dummy_weights(
        materialize(predictor, "cpu", torch.float32), seed=seed + 1, std=TINY_INIT_STD
    )
    sd = {f"talker.{k}": v for k, v in talker.state_dict().items()}
    sd.update({f"talker.code_predictor.{k}": v for k, v in predictor.state_dict().items()})
    if cfg.tts_model_type == "base":
        sd.update(_speaker_encoder_state(cfg_dict, seed + 2))
    return {k: v.contiguous() for k, v in sd.items()}


def build_tiny_snapshot(out_dir: str | Path, model_type: str = "base", seed: int = 0) -> Path:
    """Write a tiny random snapshot of `model_type` into `out_dir` (created) and return it."""
    from safetensors.torch import save_file

    from qtts.tiny_model.tokenizer import write_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(model_type)
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(GENERATION_CONFIG, f, indent=2)
    save_file(tiny_state_dict(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tiny_tokenizer(out)
    with open(out / "preprocessor_config.json", "w", encoding="utf-8") as f:
        json.dump({"processor_class": "Qwen3TTSProcessor"}, f, indent=2)
    try:
        from qtts.tiny_model.codec import write_tiny_speech_tokenizer
    except ImportError:
        log.warning("qtts.tiny_model.codec is not available: no speech_tokenizer/ written")
    else:
        write_tiny_speech_tokenizer(out, seed=seed)  # writes out/speech_tokenizer/
    return out
