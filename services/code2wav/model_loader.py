"""Loads the codec decoder for code2wav: a snapshot, its speech_tokenizer/ folder, or the tiny default."""

from __future__ import annotations

import torch

from qtts.tiny_model import ensure_tiny_snapshot
from services.code2wav.stream import CodecShape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# --dtype -> the slots engine's compute path when --decode-precision is not given.
_PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}


def _codec_shape(decoder) -> CodecShape:
    return CodecShape(
        num_codebooks=decoder.cfg.num_quantizers,
        codebook_size=decoder.cfg.codebook_size,
        samples_per_frame=decoder.samples_per_frame,
    )


def load_incremental_decoder(model: str, *, load_format: str, device: str, dtype: str):
    """(IncrementalDecoder, CodecShape) for `model` (path, hub id, or a shipped config name for dummy)."""
    from qtts.model import IncrementalDecoder, load_codec_decoder

    path = model or str(ensure_tiny_snapshot())
    decoder = load_codec_decoder(path, device=device, dtype=DTYPES[dtype], load_format=load_format)
    return IncrementalDecoder(decoder), _codec_shape(decoder)


def load_slot_decoder(
    model: str,
    *,
    load_format: str,
    device: str,
    precision: str,
    max_states: int,
    prefix_cache_entries: int = 512,
    cudnn_benchmark: bool = True,
):
    """(SlotDecoder, CodecShape): the GPU engine, its pool sized to --max-states, graphs captured
    here (minutes on a GPU) so the service reports SERVING only once it is ready."""
    from qtts.decode_engine import SlotDecoderConfig
    from qtts.decode_engine import load_slot_decoder as load

    path = model or str(ensure_tiny_snapshot())
    on_gpu = torch.device(device).type == "cuda"
    config = SlotDecoderConfig(
        max_streams=max_states,
        precision=precision,
        cuda_graphs=on_gpu,
        prefix_cache_entries=prefix_cache_entries,
        cudnn_benchmark=cudnn_benchmark,
    )
    engine = load(path, device=device, load_format=load_format, config=config)
    return engine, _codec_shape(engine.decoder)


def load_decoder(cfg):
    """The decoder the config asks for: (decoder, CodecShape)."""
    if cfg.decode_engine == "slots":
        precision = cfg.decode_precision or _PRECISION_OF_DTYPE[cfg.dtype]
        return load_slot_decoder(
            cfg.model,
            load_format=cfg.load_format,
            device=cfg.device,
            precision=precision,
            max_states=cfg.max_states,
            prefix_cache_entries=cfg.prefix_cache_entries,
            cudnn_benchmark=cfg.cudnn_benchmark,
        )
    return load_incremental_decoder(
        cfg.model, load_format=cfg.load_format, device=cfg.device, dtype=cfg.dtype
    )
