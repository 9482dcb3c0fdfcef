"""Log-mel front-end of the speaker encoder: 128 slaney mel bins at 24 kHz (n_fft 1024, hop 256).

The slaney filterbank is transformers' (`audio_utils.mel_filter_bank`); tests check it against
librosa and the reference implementation."""

from __future__ import annotations

import functools

import numpy as np
import torch

N_FFT = 1024
HOP = 256
WIN = 1024
N_MELS = 128
SAMPLE_RATE = 24000
FMIN = 0.0
FMAX = 12000.0


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    from transformers.audio_utils import hertz_to_mel

    return hertz_to_mel(np.asarray(hz, dtype=np.float64), mel_scale="slaney")


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """Inverse of `hz_to_mel`."""
    from transformers.audio_utils import mel_to_hertz

    return mel_to_hertz(np.asarray(mel, dtype=np.float64), mel_scale="slaney")


@functools.lru_cache(maxsize=8)
def slaney_mel_filterbank(
    sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS, fmin: float = FMIN, fmax: float = FMAX
) -> np.ndarray:
    """Triangular slaney-normalised mel filters [n_mels, 1 + n_fft // 2], float32 (= librosa's)."""
    # Imported here: transformers takes seconds to import and only the speaker encoder needs it.
    from transformers.audio_utils import mel_filter_bank

    weights = mel_filter_bank(
        num_frequency_bins=1 + n_fft // 2,
        num_mel_filters=n_mels,
        min_frequency=fmin,
        max_frequency=fmax,
        sampling_rate=sr,
        norm="slaney",
        mel_scale="slaney",
    )
    weights = np.ascontiguousarray(weights.T, dtype=np.float32)
    weights.flags.writeable = False
    return weights


def log_mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """Waveform [N] or [B, N] at 24 kHz -> log-mel [B, frames, 128] (float32)."""
    if wav.dim() == 1:
        wav = wav.unsqueeze(0)
    wav = wav.float()
    basis = torch.from_numpy(slaney_mel_filterbank().copy()).to(wav.device)
    window = torch.hann_window(WIN, device=wav.device)
    pad = (N_FFT - HOP) // 2
    wav = torch.nn.functional.pad(wav.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    spec = torch.stft(
        wav, N_FFT, hop_length=HOP, win_length=WIN, window=window, center=False, return_complex=True
    )
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    mel = torch.matmul(basis, mag)
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)
