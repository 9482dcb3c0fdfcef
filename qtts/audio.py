"""Audio helpers: reference-clip loading (any container, resampled to 24 kHz mono) and PCM16 output."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import soxr

from qtts.request.errors import InvalidArgument
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE as SAMPLE_RATE
from qtts.request.vocabulary import SAMPLES_PER_FRAME as SAMPLES_PER_FRAME

if TYPE_CHECKING:  # the gateway decodes audio without loading torch
    import torch

MAX_REFERENCE_SECONDS = 60.0


def load_reference_audio(data: bytes, *, max_seconds: float = MAX_REFERENCE_SECONDS) -> np.ndarray:
    """Decode a reference clip (wav/flac/mp3/ogg/... via PyAV) to float32 mono at 24 kHz.

    Channels are averaged and the rate converted with soxr (high quality), as the reference
    implementation does with librosa. Raises InvalidArgument for empty, undecodable or too long input."""
    if not data:
        raise InvalidArgument("reference audio is empty")
    wav, rate = _decode_pcm16_wav(data, max_seconds)
    if wav is None:
        wav, rate = _decode_with_pyav(data, max_seconds)
    if not np.isfinite(wav).all():
        raise InvalidArgument("reference audio contains non-finite samples")
    if rate != SAMPLE_RATE:
        wav = soxr.resample(wav, rate, SAMPLE_RATE, quality="HQ")
    return np.ascontiguousarray(wav, dtype=np.float32)


# A streamed WAV (the gateway's own stream_audio output) writes this in both size fields.
_WAV_UNKNOWN_SIZE = 0xFFFFFFFF


def check_wav_sizes(data: bytes) -> None:
    """Refuse a WAV file whose header claims more audio than it holds (a clip stored for good
    should be what it says: a header claiming 4 GB over 100 bytes made a 2 ms voice). A streamed
    WAV, both sizes 0xFFFFFFFF ("to the end"), is accepted; other containers are not looked at."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    riff = int.from_bytes(data[4:8], "little")
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if chunk == b"data":
            present = len(data) - pos - 8
            if size == _WAV_UNKNOWN_SIZE and riff == _WAV_UNKNOWN_SIZE:
                return
            if size > present or riff > len(data) - 8 + 1:  # a pad byte may be missing
                raise InvalidArgument(
                    f"the WAV header claims {size} bytes of audio (a {riff + 8}-byte file); the file "
                    f"has {present} ({len(data)} bytes): it is truncated or its header is wrong"
                )
            return
        pos += 8 + size + (size & 1)
    raise InvalidArgument("the WAV file has no data chunk within its bytes")


def _decode_pcm16_wav(data: bytes, max_seconds: float) -> tuple[np.ndarray | None, int]:
    """16-bit PCM WAV (the usual reference clip) without PyAV: one numpy pass, no per-packet
    Python callbacks, which queue behind the GIL when many requests decode at once. The same
    arithmetic as the PyAV path (int16 / 32768, channels averaged in float32), so the result is
    identical. (None, 0) for anything else: PyAV decodes it."""
    import wave

    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None, 0
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            if w.getsampwidth() != 2 or w.getcomptype() != "NONE":
                return None, 0
            channels, rate = w.getnchannels(), w.getframerate()
            if channels < 1 or rate < 1:
                return None, 0
            raw = w.readframes(w.getnframes())  # the bytes present, whatever the header claims
    except (wave.Error, EOFError):
        return None, 0
    if len(raw) // (2 * channels) > max_seconds * rate:
        raise InvalidArgument(f"reference audio is longer than {max_seconds:g} s")
    pcm = np.frombuffer(raw[: len(raw) - len(raw) % (2 * channels)], dtype="<i2")
    if pcm.size == 0:
        raise InvalidArgument("reference audio contains no samples")
    arr = pcm.reshape(-1, channels).T.astype(np.float32) / 32768.0
    return arr.astype(np.float32).mean(axis=0), rate


def _decode_with_pyav(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    import av

    chunks: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            if not streams:
                raise InvalidArgument("reference audio has no audio stream")
            rate = 0
            for frame in container.decode(streams[0]):
                rate = int(frame.sample_rate)
                pcm = _frame_to_mono(frame)
                chunks.append(pcm)
                total += pcm.shape[0]
                # Checked while decoding so a huge upload is rejected before it is all in memory.
                if total > max_seconds * rate:
                    raise InvalidArgument(f"reference audio is longer than {max_seconds:g} s")
    except InvalidArgument:
        raise
    except Exception as e:  # PyAV raises many FFmpeg error types; all mean "not decodable audio"
        raise InvalidArgument(f"reference audio could not be decoded: {e}") from e
    if total == 0 or not rate:
        raise InvalidArgument("reference audio contains no samples")
    return np.concatenate(chunks), rate


def _frame_to_mono(frame) -> np.ndarray:
    """One decoded frame -> float32 mono, averaging channels (integer formats scaled to [-1, 1])."""
    arr = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:
        arr = arr.reshape(-1, channels).T  # packed: interleaved samples in one row
    if arr.dtype.kind == "i":
        arr = arr.astype(np.float32) / float(np.iinfo(arr.dtype).max + 1)
    elif arr.dtype.kind == "u":  # 8-bit PCM is unsigned, centred on 128
        arr = (arr.astype(np.float32) - 128.0) / 128.0
    return arr.astype(np.float32).mean(axis=0)


def pcm_s16le_batch(samples: Sequence[torch.Tensor]) -> list[bytes]:
    """Float waveforms -> signed 16-bit little-endian PCM, one bytes object per waveform.

    Each sample is clipped to [-1, 1], scaled by 32767 and rounded half to even (torch.round, as
    np.round). The whole batch is converted in one pass on its device and copied back at once: one
    sync per decode step instead of one per stream. Tensors of any shape are flattened; all must be
    on one device."""
    if not samples:
        return []
    import torch  # lazily: the gateway imports this module without torch

    flat = torch.cat([a.detach().reshape(-1) for a in samples])
    pcm = flat.float().clamp(-1.0, 1.0).mul(32767.0).round().to(torch.int16).cpu().numpy()
    pcm = pcm.astype("<i2", copy=False)
    out, offset = [], 0
    for a in samples:
        n = a.numel()
        out.append(pcm[offset : offset + n].tobytes())
        offset += n
    return out
