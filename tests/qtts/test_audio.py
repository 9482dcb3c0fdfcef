"""Reference-audio loading (PyAV decode + soxr resample) and PCM16 conversion."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch

from qtts.audio import SAMPLE_RATE, SAMPLES_PER_FRAME, load_reference_audio, pcm_s16le_batch
from qtts.request.errors import InvalidArgument


def _encode(wav: np.ndarray, rate: int, fmt: str, codec: str) -> bytes:
    """wav [channels, n] float in [-1, 1] -> container bytes."""
    channels = wav.shape[0]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono" if channels == 1 else "stereo")
        frame_fmt = "s16" if codec in ("pcm_s16le", "flac") else "fltp"
        step = 1152
        for start in range(0, wav.shape[1], step):
            part = wav[:, start : start + step]
            if frame_fmt == "s16":
                arr = (np.round(part.T * 32767).astype(np.int16)).reshape(1, -1)
            else:
                arr = np.ascontiguousarray(part.astype(np.float32))
            frame = av.AudioFrame.from_ndarray(arr, format=frame_fmt, layout=stream.layout.name)
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.mark.parametrize("rate", [16000, 44100])
@pytest.mark.parametrize(
    "fmt,codec,exact_length",
    [("wav", "pcm_s16le", True), ("flac", "flac", True), ("mp3", "libmp3lame", False)],
)
def test_round_trip_to_24k(rate, fmt, codec, exact_length):
    seconds = 1.5
    data = _encode(_tone(rate, seconds)[None], rate, fmt, codec)
    wav = load_reference_audio(data)
    assert wav.dtype == np.float32 and wav.ndim == 1
    want = int(seconds * SAMPLE_RATE)
    if exact_length:
        assert abs(wav.shape[0] - want) <= 1
    else:  # mp3 adds encoder delay and padding (at most a few frames of 1152 samples)
        assert want <= wav.shape[0] <= want + 3 * 1152 * SAMPLE_RATE // rate + 1
    # Still a 440 Hz tone at the new rate: find the best alignment and correlate.
    ref = _tone(SAMPLE_RATE, seconds)
    mid = wav[2400 : 2400 + 12000]
    windows = np.lib.stride_tricks.sliding_window_view(ref[400 : 400 + 16000], 12000)
    best = (windows @ mid / (np.linalg.norm(windows, axis=1) * np.linalg.norm(mid))).max()
    assert best > 0.99
    assert 0.3 < np.abs(mid).max() < 0.6


def test_wav_at_24k_is_sample_exact():
    x = _tone(SAMPLE_RATE, 0.4)
    wav = load_reference_audio(_encode(x[None], SAMPLE_RATE, "wav", "pcm_s16le"))
    np.testing.assert_allclose(wav, x, atol=1.0 / 32767)


def test_stereo_is_averaged_to_mono():
    left = _tone(SAMPLE_RATE, 0.2, 440)
    right = _tone(SAMPLE_RATE, 0.2, 660)
    wav = load_reference_audio(_encode(np.stack([left, right]), SAMPLE_RATE, "wav", "pcm_s16le"))
    np.testing.assert_allclose(wav, (left + right) / 2, atol=2.0 / 32767)


@pytest.mark.parametrize("data", [b"", b"not audio at all" * 50, bytes(range(256)) * 40])
def test_bad_bytes_raise_invalid_argument(data):
    with pytest.raises(InvalidArgument):
        load_reference_audio(data)


def test_too_long_raises_invalid_argument():
    data = _encode(np.zeros((1, 8000 * 61), dtype=np.float32), 8000, "wav", "pcm_s16le")
    with pytest.raises(InvalidArgument, match="longer than 60"):
        load_reference_audio(data)
    assert load_reference_audio(data, max_seconds=70).shape[0] == 61 * SAMPLE_RATE


def _pcm16_reference(x: np.ndarray) -> bytes:
    """The conversion spelled out in numpy: clip to [-1, 1], scale, round half to even, int16 LE."""
    return np.round(np.clip(x.astype(np.float32), -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def test_pcm_s16le_batch_exact_values():
    lsb = 1.0 / 32767
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0, 1e-6, 1.5 * lsb, 2.5 * lsb, -0.5 * lsb], np.float32)
    (got,) = pcm_s16le_batch([torch.from_numpy(x)])
    assert got == _pcm16_reference(x)
    # Clipped at +-1 (never -32768), rounded half to even, little-endian whatever the host order.
    want = [0, 16384, -16384, 32767, -32767, 32767, -32767, 0, 2, 2, 0]
    assert np.frombuffer(got, dtype="<i2").tolist() == want
    assert got[:8] == bytes([0x00, 0x00, 0x00, 0x40, 0x00, 0xC0, 0xFF, 0x7F])


def test_pcm_s16le_batch_splits_the_batch_per_stream():
    rng = np.random.default_rng(0)
    lengths = [SAMPLES_PER_FRAME, 0, 7, 3 * SAMPLES_PER_FRAME, 1]
    waves = [(rng.standard_normal(n) * 0.7).astype(np.float32) for n in lengths]
    got = pcm_s16le_batch([torch.from_numpy(w) for w in waves])
    assert [len(b) for b in got] == [2 * n for n in lengths]
    assert got == [_pcm16_reference(w) for w in waves]
    # Any shape is flattened; other float dtypes are converted through float32.
    (shaped,) = pcm_s16le_batch([torch.from_numpy(waves[0]).reshape(1, 1, -1)])
    assert shaped == got[0]
    half = torch.from_numpy(waves[2]).to(torch.bfloat16)
    assert pcm_s16le_batch([half]) == [_pcm16_reference(half.float().numpy())]


def test_pcm_s16le_batch_empty_input():
    assert pcm_s16le_batch([]) == []
    assert pcm_s16le_batch([torch.zeros(0), torch.zeros(0)]) == [b"", b""]


@pytest.mark.parametrize("rate", [16000, SAMPLE_RATE])
@pytest.mark.parametrize("channels", [1, 2])
def test_pcm16_wav_fast_path_equals_the_pyav_decode(rate, channels):
    """16-bit PCM WAV skips PyAV; its samples are bit-identical to PyAV's decode of the same bytes."""
    from qtts.audio import _decode_pcm16_wav, _decode_with_pyav

    x = np.stack([_tone(rate, 0.7, 440 + 110 * c) for c in range(channels)])
    data = _encode(x, rate, "wav", "pcm_s16le")
    fast, fast_rate = _decode_pcm16_wav(data, 60.0)
    slow, slow_rate = _decode_with_pyav(data, 60.0)
    assert fast is not None and fast_rate == slow_rate == rate
    assert fast.dtype == slow.dtype == np.float32
    np.testing.assert_array_equal(fast, slow)


def test_other_wav_formats_and_containers_take_pyav():
    from qtts.audio import _decode_pcm16_wav

    x = _tone(SAMPLE_RATE, 0.3)
    float_wav = _encode(x[None], SAMPLE_RATE, "wav", "pcm_f32le")
    assert _decode_pcm16_wav(float_wav, 60.0) == (None, 0)
    np.testing.assert_allclose(load_reference_audio(float_wav), x, atol=1e-6)
    flac = _encode(x[None], SAMPLE_RATE, "flac", "flac")
    assert _decode_pcm16_wav(flac, 60.0) == (None, 0)
    # A truncated PCM16 WAV decodes the samples that are there.
    data = _encode(x[None], SAMPLE_RATE, "wav", "pcm_s16le")
    cut = load_reference_audio(data[: len(data) - 2000])
    assert cut.shape[0] == x.shape[0] - 1000


def test_check_wav_sizes_refuses_a_header_that_claims_more_than_the_file_holds():
    import struct

    from qtts.audio import check_wav_sizes

    def wav(riff: int, data: int, body: bytes = bytes(100)) -> bytes:
        fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, 16000, 32000, 2, 16)
        return b"RIFF" + struct.pack("<I", riff) + b"WAVE" + fmt + b"data" + struct.pack("<I", data) + body

    check_wav_sizes(wav(136, 100))  # exact
    check_wav_sizes(wav(0xFFFFFFFF, 0xFFFFFFFF))  # streamed: "to the end"
    check_wav_sizes(b"fLaC not a wav")  # other containers are the decoder's
    for riff, data in ((136, 4_000_000_000), (0xFFFFFFFF, 4_000_000_000), (4_000_000_000, 100)):
        with pytest.raises(InvalidArgument, match="claims"):
            check_wav_sizes(wav(riff, data))
    with pytest.raises(InvalidArgument, match="no data chunk"):
        check_wav_sizes(wav(136, 100)[:36])
