"""Reference clips for voice-clone benchmarks: a file from disk, or a synthetic voice-like WAV."""

from __future__ import annotations

import base64
import io
import mimetypes
import wave
from pathlib import Path

import numpy as np

from benchmarks.metrics import SAMPLE_RATE_HZ

SYNTHETIC_REF_TEXT = "This is a short reference recording used to measure streaming speech synthesis."


def synthetic_reference_wav(seconds: float = 3.0, seed: int = 0) -> bytes:
    """A mono 24 kHz s16 WAV of a vibrato harmonic tone with noise, about -12 dBFS.

    Benchmarks run on random weights, so the clip only has to be decodable audio of a realistic
    length (the reference length sets the prompt length, which is what costs compute).
    """
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE_HZ)
    t = np.arange(n) / SAMPLE_RATE_HZ
    f0 = 140.0 + 20.0 * np.sin(2 * np.pi * 5.0 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE_HZ
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t) ** 2
    signal = voice * envelope + 0.05 * rng.standard_normal(n)
    signal *= 0.25 / np.max(np.abs(signal))
    pcm = (signal * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE_HZ)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def audio_data_url(data: bytes, filename: str = "ref.wav") -> str:
    """A base64 data URL, the form the HTTP API takes for `ref_audio`."""
    mime = mimetypes.guess_type(filename)[0] or "audio/wav"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def load_reference(path: str | None, *, synthetic_seconds: float, seed: int) -> tuple[bytes, str]:
    """The reference clip bytes and a file name (for its MIME type)."""
    if path:
        return Path(path).read_bytes(), Path(path).name
    return synthetic_reference_wav(synthetic_seconds, seed), "synthetic.wav"
