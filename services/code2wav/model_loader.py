"""Loads the codec decoder for code2wav: a snapshot, its speech_tokenizer/ folder, or the tiny default."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from services.code2wav.stream import StreamLimits

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TINY_MODEL = REPO_ROOT / ".tiny" / "base"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_dir() -> Path:
    """The tiny random Base snapshot used when no --model is given (built once, gitignored)."""
    if not (DEFAULT_TINY_MODEL / "speech_tokenizer" / "config.json").is_file():
        from qtts.testing import build_tiny_snapshot

        log.info("building the tiny default snapshot in %s", DEFAULT_TINY_MODEL)
        build_tiny_snapshot(DEFAULT_TINY_MODEL, "base")
    return DEFAULT_TINY_MODEL


def load_incremental_decoder(model: str, *, load_format: str, device: str, dtype: str):
    """(IncrementalDecoder, StreamLimits) for `model` (path, hub id, or a shipped config name for dummy)."""
    from qtts.model import IncrementalDecoder, load_codec_decoder

    path = model or str(default_model_dir())
    decoder = load_codec_decoder(path, device=device, dtype=DTYPES[dtype], load_format=load_format)
    limits = StreamLimits(
        num_codebooks=decoder.cfg.num_quantizers,
        codebook_size=decoder.cfg.codebook_size,
        samples_per_frame=decoder.samples_per_frame,
    )
    return IncrementalDecoder(decoder), limits
