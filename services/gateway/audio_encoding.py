"""Output audio: resampling of the talker's 24 kHz PCM and encoding to pcm/wav/mp3/flac/opus/aac.

Every encoder takes PCM s16le mono at the output rate through `push()` and returns the bytes that
are ready to send; `finish()` returns the rest. Streaming encoders hand out bytes as they are
produced (a WAV stream starts with a header whose size fields are 0xFFFFFFFF, since the length is
not known yet); non-streaming ones return one complete file from `finish()`.
"""

from __future__ import annotations

import struct
from typing import Protocol

import numpy as np

from qtts.errors import InvalidArgument

MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
# (container, codec) for the formats PyAV encodes.
_PYAV_FORMATS = {
    "mp3": ("mp3", "libmp3lame"),
    "flac": ("flac", "flac"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
}
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
UNKNOWN_SIZE = 0xFFFFFFFF


class AudioEncoder(Protocol):
    """Turns PCM s16le chunks into the bytes of one output format."""

    media_type: str

    def push(self, pcm: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


def wav_header(sample_rate: int, data_bytes: int | None = None, channels: int = 1) -> bytes:
    """A 44-byte PCM s16le WAV header; `data_bytes=None` writes 0xFFFFFFFF (streaming) sizes."""
    if data_bytes is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        riff_size, data_size = 36 + data_bytes, data_bytes
    block_align = channels * 2
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


class PcmEncoder:
    """Raw PCM s16le: bytes pass through (buffered when not streaming)."""

    media_type = MEDIA_TYPES["pcm"]

    def __init__(self, streaming: bool):
        self._streaming = streaming
        self._buffer = bytearray()

    def push(self, pcm: bytes) -> bytes:
        if self._streaming:
            return pcm
        self._buffer += pcm
        return b""

    def finish(self) -> bytes:
        return bytes(self._buffer)


class WavEncoder:
    """WAV: a streaming header then PCM as it comes, or one complete file with exact sizes."""

    media_type = MEDIA_TYPES["wav"]

    def __init__(self, sample_rate: int, streaming: bool):
        self._rate = sample_rate
        self._streaming = streaming
        self._header_sent = False
        self._buffer = bytearray()

    def header(self) -> bytes:
        """The streaming header, once; lets a server send the first byte before any audio."""
        if not self._streaming or self._header_sent:
            return b""
        self._header_sent = True
        return wav_header(self._rate)

    def push(self, pcm: bytes) -> bytes:
        if self._streaming:
            return self.header() + pcm
        self._buffer += pcm
        return b""

    def finish(self) -> bytes:
        if self._streaming:
            return self.header()
        return wav_header(self._rate, len(self._buffer)) + bytes(self._buffer)


class _ByteSink:
    """A write-only file object: PyAV muxes into it and the encoder drains what was written."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class PyAVEncoder:
    """mp3 / flac / opus (Ogg) / aac (ADTS) through PyAV's encoders, muxed as packets arrive."""

    def __init__(self, fmt: str, sample_rate: int, streaming: bool):
        container, codec = _PYAV_FORMATS[fmt]
        self.media_type = MEDIA_TYPES[fmt]
        self._rate = sample_rate
        self._streaming = streaming
        self._sink = _ByteSink()
        import av  # imported here so pcm/wav-only use does not pay for it

        self._av = av
        self._container = av.open(self._sink, mode="w", format=container)
        self._stream = self._container.add_stream(codec, rate=sample_rate, layout="mono")
        self._pts = 0

    def _encode(self, frame) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def push(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if samples.size:
            frame = self._av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate = self._rate
            frame.pts = self._pts
            self._pts += samples.size
            self._encode(frame)
        return self._sink.drain() if self._streaming else b""

    def finish(self) -> bytes:
        self._encode(None)
        self._container.close()
        return self._sink.drain()


def check_output_format(fmt: str, sample_rate: int) -> None:
    """Reject format/rate pairs the encoder cannot produce, before any work is done."""
    if fmt not in MEDIA_TYPES:
        raise InvalidArgument(f"unsupported response_format {fmt!r}", param="response_format")
    if fmt == "opus" and sample_rate not in OPUS_SAMPLE_RATES:
        raise InvalidArgument(
            f"opus supports sample rates {', '.join(map(str, OPUS_SAMPLE_RATES))}, got {sample_rate}",
            param="sample_rate",
        )


def make_encoder(fmt: str, sample_rate: int, streaming: bool) -> AudioEncoder:
    """The encoder of `fmt` at `sample_rate` (PCM input at that rate)."""
    check_output_format(fmt, sample_rate)
    if fmt == "pcm":
        return PcmEncoder(streaming)
    if fmt == "wav":
        return WavEncoder(sample_rate, streaming)
    return PyAVEncoder(fmt, sample_rate, streaming)


class Resampler:
    """Streaming soxr resampler of PCM s16le from the native rate to the requested one."""

    def __init__(self, in_rate: int, out_rate: int):
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = None
        if in_rate != out_rate:
            import soxr

            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16", quality="HQ")

    @property
    def passthrough(self) -> bool:
        return self._stream is None

    def push(self, pcm: bytes) -> bytes:
        if self._stream is None:
            return pcm
        out = self._stream.resample_chunk(np.frombuffer(pcm, dtype="<i2"), last=False)
        return np.ascontiguousarray(out, dtype="<i2").tobytes()

    def flush(self) -> bytes:
        if self._stream is None:
            return b""
        out = self._stream.resample_chunk(np.zeros(0, dtype="<i2"), last=True)
        return np.ascontiguousarray(out, dtype="<i2").tobytes()
