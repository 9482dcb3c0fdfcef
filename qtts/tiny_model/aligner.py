"""A tiny random Qwen3-ForcedAligner snapshot in the real folder layout, for tests and `--aligner`.

Narrow and shallow (2 encoder layers, 2 decoder layers, width 32) but with the real ids, the real
text vocabulary size, the real 5000 timestamp classes of 80 ms and the real audio front end
(128 mel bins, 100-frame conv chunks); `config.json` is laid out as the Hugging Face checkpoint's,
so the official `qwen_asr.Qwen3ForcedAligner.from_pretrained(folder)` loads it too.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

from qtts.resources import state_dir

DEFAULT_TINY_ALIGNER = state_dir() / ".tiny" / "qwen3-forcedaligner-tiny"
# Random weights of a dummy load's scale give every timestamp slot the same class (flat attention
# averages the whole audio away). Wider weights and a gain on the per-head q/k norms sharpen the
# attention, so the slots of a tiny model differ and comparisons against the official code test
# the timestamps, the repair of non-rising runs and the word order, not one repeated class.
TINY_WEIGHT_STD = 0.2
TINY_QK_NORM_GAIN = 4.0

PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length": 30,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 480000,
    "nb_max_frames": 3000,
    "padding_side": "right",
    "padding_value": 0.0,
    "processor_class": "Qwen3ASRProcessor",
    "return_attention_mask": True,
    "sampling_rate": 16000,
}

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ASRForConditionalGeneration"],
    "model_type": "qwen3_asr",
    "support_languages": ["Chinese", "English", "Japanese", "Korean", "German", "French", "Spanish"],
    "timestamp_token_id": 151705,
    "timestamp_segment_time": 80,
    "transformers_version": "4.57.3",
    "thinker_config": {
        "model_type": "qwen3_forced_aligner",
        "classify_num": 5000,
        "audio_token_id": 151676,
        "audio_start_token_id": 151669,
        "audio_end_token_id": 151670,
        "audio_config": {
            "num_mel_bins": 128,
            "d_model": 32,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "output_dim": 32,
            "downsample_hidden_size": 8,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
            "activation_function": "gelu",
            "scale_embedding": False,
        },
        "text_config": {
            "vocab_size": 152064,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
            "max_position_embeddings": 65536,
            "tie_word_embeddings": False,
        },
    },
}


def build_tiny_aligner_snapshot(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, the tokenizer files and preprocessor_config.json."""
    import torch
    from safetensors.torch import save_file

    from qtts.model.aligner.config import AlignerConfig
    from qtts.model.aligner.network import AlignerNet
    from qtts.model.aligner.tokenizer import write_aligner_tokenizer_config
    from qtts.model.dummy import init_dummy_weights
    from qtts.tiny_model.tokenizer import write_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = copy.deepcopy(TINY_CONFIG)
    net = AlignerNet(AlignerConfig.from_dict(raw))
    init_dummy_weights(net, seed=seed, std=TINY_WEIGHT_STD)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(TINY_QK_NORM_GAIN)
    state = {f"thinker.{k}": v.detach().to(torch.float32).contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2), encoding="utf-8")
    write_tiny_tokenizer(out)
    write_aligner_tokenizer_config(out)
    return out


def ensure_tiny_aligner(path: Path = DEFAULT_TINY_ALIGNER) -> Path:
    """Build the tiny aligner at `path` unless one is there; concurrent builders race on a rename."""
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_aligner_snapshot(tmp)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path
