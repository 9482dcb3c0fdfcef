"""Mel front-end and ECAPA-TDNN speaker encoder against librosa and the official implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qtts.model.mel import hz_to_mel, log_mel_spectrogram, mel_to_hz, slaney_mel_filterbank
from qtts.model.speaker_encoder import SpeakerEncoder
from qtts.request.errors import InvalidArgument
from tests.official import import_qwen_tts

TINY = {
    "mel_dim": 128,
    "enc_dim": 48,
    "enc_channels": [32, 32, 32, 32, 96],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 16,
    "enc_res2net_scale": 8,
    "enc_se_channels": 16,
    "sample_rate": 24000,
}


def _official():
    import_qwen_tts()
    from qwen_tts.core.models import modeling_qwen3_tts as m
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    return m, Qwen3TTSSpeakerEncoderConfig


def _wav(seconds: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(24000 * seconds)) / 24000
    tone = 0.3 * torch.sin(2 * torch.pi * 220 * t) * torch.sin(2 * torch.pi * 3 * t)
    return (tone + 0.05 * torch.randn(t.shape, generator=g)).float()


def test_filterbank_equals_librosa():
    librosa = pytest.importorskip("librosa")
    ref = librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    ours = slaney_mel_filterbank()
    assert ours.shape == ref.shape == (128, 513) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("sr", "n_fft", "n_mels", "fmin", "fmax"), [(16000, 512, 80, 20.0, 7600.0)])
def test_filterbank_equals_librosa_other_shapes(sr, n_fft, n_mels, fmin, fmax):
    librosa = pytest.importorskip("librosa")
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    ours = slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    assert ours.shape == ref.shape == (n_mels, 1 + n_fft // 2)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


def test_mel_scale_equals_librosa():
    librosa = pytest.importorskip("librosa")
    hz = np.array([0.0, 200.0, 999.0, 1000.0, 4000.0, 12000.0])
    np.testing.assert_allclose(hz_to_mel(hz), librosa.hz_to_mel(hz, htk=False), rtol=1e-12)
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)), hz, rtol=1e-12, atol=1e-9)


@pytest.mark.reference
@pytest.mark.parametrize("seconds", [0.5, 3.2])
def test_log_mel_equals_official(seconds):
    m, _ = _official()
    wav = _wav(seconds, seed=1)
    ref = m.mel_spectrogram(
        wav.unsqueeze(0),
        n_fft=1024,
        num_mels=128,
        sampling_rate=24000,
        hop_size=256,
        win_size=1024,
        fmin=0,
        fmax=12000,
    ).transpose(1, 2)
    ours = log_mel_spectrogram(wav)
    assert ours.shape == ref.shape == (1, len(wav) // 256, 128)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.reference
def test_xvector_equals_official():
    m, cfg_cls = _official()
    torch.manual_seed(0)
    official = m.Qwen3TTSSpeakerEncoder(cfg_cls(**TINY)).eval()
    ours = SpeakerEncoder.from_config(TINY)
    ours.load_state_dict(official.state_dict(), strict=True)
    for seed, seconds in ((2, 1.0), (3, 4.5)):
        wav = _wav(seconds, seed)
        mels = m.mel_spectrogram(
            wav.unsqueeze(0),
            n_fft=1024,
            num_mels=128,
            sampling_rate=24000,
            hop_size=256,
            win_size=1024,
            fmin=0,
            fmax=12000,
        ).transpose(1, 2)
        with torch.no_grad():
            want = official(mels)[0]
        got = ours.embed(wav)
        assert got.shape == (48,) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Different voices give different embeddings (the pooling is not degenerate).
    assert (ours.embed(_wav(1.0, 2)) - ours.embed(_wav(1.0, 9) * 0.5)).abs().max() > 1e-3


def test_checkpoint_key_names():
    names = set(SpeakerEncoder.from_config(TINY).state_dict())
    assert {
        "blocks.0.conv.weight",
        "blocks.1.res2net_block.blocks.6.conv.weight",
        "blocks.3.se_block.conv2.bias",
    } <= names
    assert {"mfa.conv.weight", "asp.tdnn.conv.weight", "asp.conv.weight", "fc.weight", "fc.bias"} <= names


def test_bad_inputs():
    enc = SpeakerEncoder.from_config(TINY)
    with pytest.raises(InvalidArgument):
        enc.embed(torch.zeros(100))
    with pytest.raises(ValueError, match="mono"):
        enc.embed(torch.zeros(2, 24000))
    with pytest.raises(ValueError, match="same length"):
        SpeakerEncoder.from_config({**TINY, "enc_dilations": [1, 2]})
