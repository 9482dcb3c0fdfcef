"""Output audio: time-stretch and resampling of the talker's 24 kHz PCM, and encoding to
pcm/wav/mp3/flac/opus/aac/mulaw/alaw.

Every encoder takes PCM s16le mono at the output rate through `push()` and returns the bytes that
are ready to send; `finish()` returns the rest. Streaming encoders hand out bytes as they are
produced (a WAV stream starts with a header whose size fields are 0xFFFFFFFF, since the length is
not known yet); non-streaming ones return one complete file from `finish()`.
"""

from __future__ import annotations

import struct
from typing import Protocol

import numpy as np

from qtts.request.errors import InvalidArgument

MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "mulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
}
# (container, codec) for the formats PyAV encodes.
_PYAV_FORMATS = {
    "mp3": ("mp3", "libmp3lame"),
    "flac": ("flac", "flac"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
}
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)
# G.711 as telephony carries it: raw bytes (one a sample, no container or header) at 8 kHz.
G711_CODECS = {"mulaw": "pcm_mulaw", "alaw": "pcm_alaw"}
G711_SAMPLE_RATE = 8000
MIN_SPEED, MAX_SPEED = 0.25, 4.0
# One atempo instance is asked for no more than older FFmpeg releases accept; beyond, they chain.
_ATEMPO_MIN, _ATEMPO_MAX = 0.5, 2.0
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


class G711Encoder:
    """mulaw / alaw: raw G.711 bytes through PyAV's pcm_mulaw / pcm_alaw encoders, one byte a sample.

    No container: a telephony peer (RTP, Twilio/Asterisk media streams) takes the bare bytes, and
    each chunk is sent as soon as it is encoded."""

    def __init__(self, fmt: str, sample_rate: int, streaming: bool):
        import av

        self.media_type = MEDIA_TYPES[fmt]
        self._av = av
        self._rate = sample_rate
        self._streaming = streaming
        self._buffer = bytearray()
        self._codec = av.CodecContext.create(G711_CODECS[fmt], "w")
        self._codec.sample_rate = sample_rate
        self._codec.layout = "mono"
        self._codec.format = "s16"
        self._codec.open()
        self._pts = 0

    def _encode(self, frame) -> bytes:
        return b"".join(bytes(packet) for packet in self._codec.encode(frame))

    def push(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if not samples.size:
            return b""
        frame = self._av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        self._pts += samples.size
        data = self._encode(frame)
        if self._streaming:
            return data
        self._buffer += data
        return b""

    def finish(self) -> bytes:
        data = bytes(self._buffer) + self._encode(None)
        self._buffer.clear()
        return data


def check_output_format(fmt: str, sample_rate: int) -> None:
    """Reject format/rate pairs the encoder cannot produce, before any work is done."""
    if fmt not in MEDIA_TYPES:
        raise InvalidArgument(f"unsupported response_format {fmt!r}", param="response_format")
    if fmt == "opus" and sample_rate not in OPUS_SAMPLE_RATES:
        raise InvalidArgument(
            f"opus supports sample rates {', '.join(map(str, OPUS_SAMPLE_RATES))}, got {sample_rate}",
            param="sample_rate",
        )
    if fmt in G711_CODECS and sample_rate != G711_SAMPLE_RATE:
        raise InvalidArgument(
            f"{fmt} is G.711 at {G711_SAMPLE_RATE} Hz only, got sample_rate {sample_rate}",
            param="sample_rate",
        )


def make_encoder(fmt: str, sample_rate: int, streaming: bool) -> AudioEncoder:
    """The encoder of `fmt` at `sample_rate` (PCM input at that rate)."""
    check_output_format(fmt, sample_rate)
    if fmt == "pcm":
        return PcmEncoder(streaming)
    if fmt == "wav":
        return WavEncoder(sample_rate, streaming)
    if fmt in G711_CODECS:
        return G711Encoder(fmt, sample_rate, streaming)
    return PyAVEncoder(fmt, sample_rate, streaming)


def check_speed(speed: float) -> None:
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidArgument(f"speed must be in {MIN_SPEED}..{MAX_SPEED}, got {speed}", param="speed")


def atempo_factors(speed: float) -> list[float]:
    """`speed` as a product of atempo factors, each within 0.5..2.0 (0.25 = 0.5 x 0.5)."""
    check_speed(speed)
    factors = []
    while speed < _ATEMPO_MIN:
        factors.append(_ATEMPO_MIN)
        speed /= _ATEMPO_MIN
    while speed > _ATEMPO_MAX:
        factors.append(_ATEMPO_MAX)
        speed /= _ATEMPO_MAX
    return [*factors, speed]


class TimeStretch:
    """Pitch-preserving time-stretch of a PCM s16le mono stream by `speed` (2.0 = twice as fast,
    half the duration): libavfilter's `atempo` through PyAV, chained where one instance cannot
    reach. One filter graph per stream, fed each chunk as it comes; `flush()` drains the tail."""

    def __init__(self, sample_rate: int, speed: float):
        import av

        self._av = av
        self._rate = sample_rate
        self._pts = 0
        graph = av.filter.Graph()
        nodes = [
            graph.add_abuffer(
                format="s16", sample_rate=sample_rate, layout="mono", time_base=f"1/{sample_rate}"
            )
        ]
        nodes += [graph.add("atempo", f"{factor:.6f}") for factor in atempo_factors(speed)]
        nodes += [graph.add("aformat", "sample_fmts=s16:channel_layouts=mono"), graph.add("abuffersink")]
        for a, b in zip(nodes, nodes[1:], strict=False):
            a.link_to(b)
        graph.configure()
        self._graph = graph
        self._done = False

    def _drain(self) -> bytes:
        parts = []
        while True:
            try:
                frame = self._graph.pull()
            except (self._av.error.BlockingIOError, self._av.error.EOFError):
                break
            parts.append(np.ascontiguousarray(frame.to_ndarray().reshape(-1), dtype="<i2").tobytes())
        return b"".join(parts)

    def push(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2")
        if not samples.size or self._done:
            return b""
        frame = self._av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        self._pts += samples.size
        self._graph.push(frame)
        return self._drain()

    def flush(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        self._graph.push(None)
        return self._drain()


class Resampler:
    """The talker's PCM s16le to the output: an optional time-stretch (`speed` != 1.0, at the native
    rate), then a streaming soxr resampler from the native rate to the requested one."""

    def __init__(self, in_rate: int, out_rate: int, speed: float = 1.0):
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stretch = TimeStretch(in_rate, speed) if speed != 1.0 else None
        self._stream = None
        if in_rate != out_rate:
            import soxr

            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16", quality="HQ")

    @property
    def passthrough(self) -> bool:
        return self._stream is None and self._stretch is None

    def _resample(self, pcm: bytes, last: bool) -> bytes:
        if self._stream is None:
            return pcm
        out = self._stream.resample_chunk(np.frombuffer(pcm, dtype="<i2"), last=last)
        return np.ascontiguousarray(out, dtype="<i2").tobytes()

    def push(self, pcm: bytes) -> bytes:
        if self._stretch is not None:
            pcm = self._stretch.push(pcm)
        return self._resample(pcm, last=False)

    def flush(self) -> bytes:
        tail = self._stretch.flush() if self._stretch is not None else b""
        if self._stream is None:
            return tail
        return self._resample(tail, last=True)
