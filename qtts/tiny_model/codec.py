"""A tiny random speech tokenizer in the real checkpoint layout (real codebook sizes, 24 kHz,
1920 samples per frame, small widths), loadable by this package and by the official one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qtts.model.codec_decoder import CodecDecoder, CodecDecoderConfig, init_dummy_weights
from qtts.model.codec_encoder import build_mimi_encoder, init_dummy_codebooks

TINY_DECODER_CONFIG: dict[str, Any] = {
    "attention_bias": False,
    "codebook_dim": 64,
    "codebook_size": 2048,
    "decoder_dim": 64,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "latent_dim": 64,
    "layer_scale_initial_scale": 0.01,
    "max_position_embeddings": 8000,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "num_quantizers": 16,
    "num_semantic_quantizers": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000,
    "semantic_codebook_size": 4096,
    "sliding_window": 72,
    "upsample_rates": [8, 5, 4, 3],
    "upsampling_ratios": [2, 2],
    "vector_quantization_hidden_dimension": 64,
}

TINY_ENCODER_CONFIG: dict[str, Any] = {
    "_frame_rate": 12.5,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "audio_channels": 1,
    "codebook_dim": 16,
    "codebook_size": 2048,
    "compress": 2,
    "dilation_growth_rate": 2,
    "head_dim": 16,
    "hidden_act": "gelu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "kernel_size": 7,
    "last_kernel_size": 3,
    "layer_scale_initial_scale": 0.01,
    "max_position_embeddings": 8000,
    "model_type": "mimi",
    "norm_eps": 1e-5,
    "num_attention_heads": 2,
    "num_filters": 8,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "num_quantizers": 32,
    "num_residual_layers": 1,
    "num_semantic_quantizers": 1,
    "pad_mode": "constant",
    "residual_kernel_size": 3,
    "rope_theta": 10000.0,
    "sampling_rate": 24000,
    "sliding_window": 250,
    "trim_right_ratio": 1.0,
    "upsample_groups": 32,
    "upsampling_ratios": [8, 6, 5, 4],
    "use_cache": False,
    "use_causal_conv": True,
    "use_conv_shortcut": False,
    "use_streaming": False,
    "vector_quantization_hidden_dimension": 16,
}

PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}


def speech_tokenizer_config(encoder_config: dict[str, Any], decoder_config: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "encoder_config": encoder_config,
        "decoder_config": decoder_config,
        "transformers_version": "4.57.3",
    }


def random_mimi_encoder_state(encoder_config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Seeded random Mimi encoder weights (decoder half removed) with non-trivial codebooks."""
    torch.manual_seed(seed)
    model = build_mimi_encoder(encoder_config)
    init_dummy_codebooks(model, seed + 1)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def write_tiny_speech_tokenizer(dir: Path, seed: int = 0) -> Path:
    """Write `dir/speech_tokenizer/{config.json, model.safetensors, preprocessor_config.json}`."""
    # Tiny tensors: extra OpenMP threads only spin against each other (30x slower on a busy box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _write(Path(dir), seed)
    finally:
        torch.set_num_threads(threads)


def _write(dir: Path, seed: int) -> Path:
    from safetensors.torch import save_file

    out = dir / "speech_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    decoder = CodecDecoder(CodecDecoderConfig.from_dict(TINY_DECODER_CONFIG))
    init_dummy_weights(decoder, seed)
    tensors = {f"decoder.{k}": v.contiguous() for k, v in decoder.state_dict().items()}
    tensors.update(
        {f"encoder.{k}": v for k, v in random_mimi_encoder_state(TINY_ENCODER_CONFIG, seed).items()}
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = speech_tokenizer_config(TINY_ENCODER_CONFIG, TINY_DECODER_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    return out
