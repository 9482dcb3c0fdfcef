"""Mimi-based speech-tokenizer encoder: codes exactly equal to the official tokenizer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qtts.model.codec_encoder import CodecEncoder
from tests.official import import_qwen_tts


@pytest.fixture(scope="module")
def snapshot(tiny_codec_dir) -> Path:
    return tiny_codec_dir


def _wav(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 200 * t * (1 + t)) + 0.05 * torch.randn(n, generator=g)).float()


@pytest.mark.reference
def test_codes_equal_official(snapshot):
    qwen_tts = import_qwen_tts()
    official = qwen_tts.Qwen3TTSTokenizer.from_pretrained(str(snapshot / "speech_tokenizer"))
    encoder = CodecEncoder.load(snapshot)
    for n, seed in ((1000, 1), (24000, 2), (3 * 24000 + 77, 3)):
        wav = _wav(n, seed)
        codes = encoder.encode(wav)
        want = official.encode(wav.numpy(), sr=24000).audio_codes[0]
        assert codes.shape == (-(-n // 1920), 16) and codes.dtype == torch.long
        assert torch.equal(codes, want.cpu())
    # Random codebooks: the codes are spread, not a constant.
    assert len(codes.unique()) > 50 and int(codes.max()) < 2048


def test_loads_from_speech_tokenizer_folder_and_dummy(snapshot):
    wav = _wav(5000, 4)
    a = CodecEncoder.load(snapshot).encode(wav)
    b = CodecEncoder.load(snapshot / "speech_tokenizer").encode(wav)
    assert torch.equal(a, b)
    dummy = CodecEncoder.load(snapshot, load_format="dummy")
    codes = dummy.encode(wav)
    assert codes.shape == (3, 16)
    assert torch.equal(codes, CodecEncoder.load(snapshot, load_format="dummy").encode(wav))  # seeded


def test_rejects_bad_input(snapshot):
    encoder = CodecEncoder.load(snapshot)
    with pytest.raises(ValueError, match="mono"):
        encoder.encode(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="mono"):
        encoder.encode(torch.zeros(0))
