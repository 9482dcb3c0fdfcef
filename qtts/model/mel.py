"""Log-mel front-end of the speaker encoder: 128 slaney mel bins at 24 kHz (n_fft 1024, hop 256).

The slaney filterbank is computed here with librosa's formulas (librosa is not a runtime
dependency); tests check it against librosa and the reference implementation."""

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

_F_SP = 200.0 / 3  # slaney: linear below 1 kHz, 200/3 Hz per mel
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _F_SP
    log = hz >= _MIN_LOG_HZ
    return np.where(log, _MIN_LOG_MEL + np.log(np.maximum(hz, 1e-12) / _MIN_LOG_HZ) / _LOGSTEP, mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = _F_SP * mel
    log = mel >= _MIN_LOG_MEL
    return np.where(log, _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel - _MIN_LOG_MEL)), hz)


@functools.lru_cache(maxsize=8)
def slaney_mel_filterbank(
    sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS, fmin: float = FMIN, fmax: float = FMAX
) -> np.ndarray:
    """Triangular slaney-normalised mel filters [n_mels, 1 + n_fft // 2], float32 (= librosa's)."""
    fft_freqs = np.linspace(0, float(sr) / 2, 1 + n_fft // 2)
    mel_f = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels]))[:, None]
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
