"""Helpers that run the official `qwen-tts` package on a tiny snapshot and capture what it feeds
its talker (prompt embeddings) and what it generates (codes), for comparison with ours."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from tests.official import import_qwen_tts


class _Captured(Exception):
    pass


@dataclass
class OfficialPrompt:
    embeds: torch.Tensor  # [B, L, H] left-padded
    attention_mask: torch.Tensor  # [B, L]
    trailing: torch.Tensor  # [B, N, H] padded with tts_pad
    pad_embed: torch.Tensor  # [H]


def load_official(folder):
    qt = import_qwen_tts()
    model = qt.Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32)
    model.model.eval()
    return model


def voice_clone_item(x_vector: torch.Tensor, ref_codes: torch.Tensor | None, ref_text: str | None):
    qt = import_qwen_tts()
    return qt.VoiceClonePromptItem(
        ref_code=ref_codes,
        ref_spk_embedding=x_vector,
        x_vector_only_mode=ref_codes is None,
        icl_mode=ref_codes is not None,
        ref_text=ref_text,
    )


def _call(model, task: str, **kw):
    if task == "custom_voice":
        return model.generate_custom_voice(**kw)
    if task == "voice_design":
        return model.generate_voice_design(**kw)
    return model.generate_voice_clone(**kw)


def official_prompt(model, task: str, **kw) -> OfficialPrompt:
    """The inputs the official wrapper hands to `talker.generate` (nothing is generated)."""
    talker = model.model.talker
    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)
        raise _Captured

    orig = talker.generate
    talker.generate = capture
    try:
        _call(model, task, **kw)
    except _Captured:
        pass
    finally:
        talker.generate = orig
    return OfficialPrompt(
        embeds=seen["inputs_embeds"],
        attention_mask=seen["attention_mask"],
        trailing=seen["trailing_text_hidden"],
        pad_embed=seen["tts_pad_embed"].reshape(-1),
    )


def official_codes(
    model, task: str, frames: int | None = None, max_new_tokens: int = 40, **kw
) -> list[torch.Tensor]:
    """Greedy codes of the official package. With `frames`, EOS is masked for every step and
    exactly `frames` frames come out (its talker makes max_new_tokens - 1 frames)."""
    talker = model.model.talker
    orig_generate = talker.generate
    if frames is not None:
        max_new_tokens = frames + 1

        @functools.wraps(orig_generate)
        def forced(*a, **k):
            k["min_new_tokens"] = k["max_new_tokens"]
            return orig_generate(*a, **k)

        talker.generate = forced
    captured = {}
    orig_model_generate = model.model.generate

    def grab(*a, **k):
        out = orig_model_generate(*a, **k)
        captured["codes"] = out[0]
        return out

    model.model.generate = grab
    tok = model.model.speech_tokenizer
    orig_decode = tok.decode
    tok.decode = lambda items: ([np.zeros(1920, dtype=np.float32) for _ in items], 24000)
    try:
        _call(model, task, do_sample=False, subtalker_dosample=False, max_new_tokens=max_new_tokens, **kw)
    finally:
        talker.generate = orig_generate
        model.model.generate = orig_model_generate
        tok.decode = orig_decode
    return [c.detach().cpu().long() for c in captured["codes"]]
