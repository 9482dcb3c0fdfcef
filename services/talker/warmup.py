"""A short generation run before the talker reports SERVING, so the first real request is not the one
that pays for lazy initialisation (allocator growth, kernel selection, tokenizer caches)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from qtts.serving.device_failure import is_fatal_device_error

log = logging.getLogger(__name__)

WARMUP_ID = "__warmup__"


def _warmup_spec(bundle: Any) -> Any:
    from qtts.model import SynthesisSpec, VoicePrompt

    info = bundle.info
    text = "Warm up."
    if info.model_type == "custom_voice":
        return SynthesisSpec(text=text, task="custom_voice", speaker=sorted(info.speakers)[0])
    if info.model_type == "voice_design":
        return SynthesisSpec(text=text, task="voice_design", instruct="A calm, clear voice.")
    import torch

    # x-vector-only clone with a zero speaker embedding: needs no reference audio or encoders.
    hidden = bundle.config.talker.decoder.hidden_size
    voice = VoicePrompt(x_vector=torch.zeros(hidden), ref_codes=None, ref_text=None, x_vector_only=True)
    return SynthesisSpec(text=text, task="voice_clone", voice_prompt=voice)


def warm_up(bundle: Any, generator: Any, frames: int = 2) -> bool:
    """Prefill one prompt and generate `frames` frames; False (logged) when the model cannot."""
    start = time.perf_counter()
    try:
        prompt = bundle.build_prompt(_warmup_spec(bundle))
        sampling = dataclasses.replace(bundle.generation_defaults, seed=0)
        generator.add(WARMUP_ID, prompt, sampling, frames)
        for _ in range(frames + 2):
            if not generator.num_active:
                break
            generator.step()
    except Exception as exc:  # noqa: BLE001 - a warm-up failure must not keep a working model from serving
        if is_fatal_device_error(exc):
            raise  # not a working model: the process must end, never serve on a dead device
        log.exception("warm-up generation failed; serving without it")
        return False
    finally:
        try:
            generator.cancel(WARMUP_ID)
        except Exception:  # noqa: BLE001
            pass
    log.info("warm-up took %.3f s", time.perf_counter() - start)
    return True
