"""Helpers for the engine tests: prompts with random embeddings, the reference run."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from qtts.model import EagerGenerator, SamplingParams, TalkerPrompt


def make_prompt(
    bundle,
    prompt_len: int,
    trailing: int,
    seed: int,
    max_frames: int = 40,
    prefix: torch.Tensor | None = None,
) -> TalkerPrompt:
    """Random prompt embeddings (any mode is just embeddings to the engine); `prefix` replaces the
    leading positions (a shared voice prefix)."""
    h = bundle.config.talker.decoder.hidden_size
    g = torch.Generator().manual_seed(seed)
    dtype = bundle.dtype
    embeds = torch.randn(prompt_len, h, generator=g, dtype=dtype)
    if prefix is not None:
        embeds[: prefix.shape[0]] = prefix
    return TalkerPrompt(
        embeds=embeds,
        trailing=torch.randn(trailing, h, generator=g, dtype=dtype),
        pad_embed=torch.randn(h, generator=g, dtype=dtype),
        ref_codes=None,
        max_frames=max_frames,
        num_text_tokens=max(trailing, 1),
    )


def run_alone(bundle, prompt: TalkerPrompt, sampling: SamplingParams, max_new_frames: int | None) -> list:
    """The model core's reference: this request alone through EagerGenerator."""
    gen = EagerGenerator(bundle, max_batch=1)
    gen.add("solo", prompt, sampling, max_new_frames)
    outs = []
    while gen.num_active:
        outs += gen.step()
    return outs


def float32_copy_on(bundle, device: torch.device) -> SimpleNamespace:
    """The tiny bundle's weights copied to `device` in float32 (the fused kernels compiled on a GPU
    run there in float32, where the CPU tests run float64 under Triton's interpreter)."""
    return SimpleNamespace(
        talker=copy.deepcopy(bundle.talker).to(device, torch.float32),
        code_predictor=copy.deepcopy(bundle.code_predictor).to(device, torch.float32),
        config=bundle.config,
        device=device,
        dtype=torch.float32,
    )
