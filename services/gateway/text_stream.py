"""Text streamed in (WebSocket and gRPC): the buffered text cut into segments at sentence ends,
and one segment's synthesis through the ordinary request path.

Each segment is one talker request, synthesised after the previous one in order, so text-in needs
nothing from the talker beyond what a plain request uses. The cost: every segment pays its own
prefill and first chunk, and prosody does not carry across a segment boundary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from .audio_encoding import Resampler, check_output_format, make_encoder
from .job import AudioPiece, SpeechFields
from .synthesis import SynthesisStream, Synthesizer

GRANULARITIES = ("sentence", "clause", "none")
# Abbreviation-prone ASCII marks end a unit only when whitespace follows; the CJK (and Devanagari,
# Arabic) marks are never abbreviations and end one at once.
_ASCII_SENTENCE = frozenset(".!?")
_SCRIPT_SENTENCE = frozenset("。！？…।॥؟")
_ASCII_CLAUSE = frozenset(",;:")
_SCRIPT_CLAUSE = frozenset("，；、،")
# Closing quotes and brackets right after a mark belong to the unit it ends.
_CLOSERS = frozenset("\"')]}”’»」』）")


class TextSplitter:
    """Buffers text pieces and hands out complete segments (pure, no I/O).

    `feed` returns the segments the new text completed; `flush` returns the rest of the buffer.
    A buffer longer than `max_chars` without a boundary is cut at its last space before the limit,
    so no segment is ever refused as too long.
    """

    def __init__(self, granularity: str = "sentence", max_chars: int = 0):
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        self.granularity = granularity
        self.max_chars = max_chars
        ascii_marks, script_marks = set(), set()
        if granularity != "none":
            ascii_marks |= _ASCII_SENTENCE
            script_marks |= _SCRIPT_SENTENCE
        if granularity == "clause":
            ascii_marks |= _ASCII_CLAUSE
            script_marks |= _SCRIPT_CLAUSE
        self._ascii, self._script = frozenset(ascii_marks), frozenset(script_marks)
        self._buf = ""
        self._scanned = 0  # the buffer before this index holds no boundary

    @property
    def buffered(self) -> str:
        return self._buf

    def reset(self) -> None:
        self._buf, self._scanned = "", 0

    def feed(self, text: str) -> list[str]:
        self._buf += text
        segments = self._cut_boundaries()
        segments += self._cut_overlong()
        return segments

    def flush(self) -> list[str]:
        segments = self._cut_boundaries()
        segments += self._cut_overlong()
        tail = self._buf.strip()
        self.reset()
        return segments + ([tail] if tail else [])

    def _cut_boundaries(self) -> list[str]:
        segments, buf, start, i = [], self._buf, 0, self._scanned
        while i < len(buf):
            ch = buf[i]
            if ch not in self._ascii and ch not in self._script:
                i += 1
                continue
            j = i + 1
            while j < len(buf) and buf[j] in _CLOSERS:
                j += 1
            if ch in self._ascii:
                if j == len(buf):
                    break  # a space may still come (or a digit: "3.14")
                if not buf[j].isspace():
                    i = j
                    continue
            piece = buf[start:j].strip()
            if piece:
                segments.append(piece)
            start = i = j
        self._buf = buf[start:]
        self._scanned = max(0, i - start)
        return segments

    def _cut_overlong(self) -> list[str]:
        segments = []
        while self.max_chars and len(self._buf.strip()) > self.max_chars:
            buf = self._buf.lstrip()
            cut = buf.rfind(" ", 0, self.max_chars + 1)
            cut = cut if cut > 0 else self.max_chars
            segments.append(buf[:cut].strip())
            self._buf, self._scanned = buf[cut:], 0
        return segments


@dataclass(frozen=True)
class SegmentAudio:
    """How a segment's audio is encoded: `streaming` hands out bytes as they are produced; otherwise
    one complete file comes at the end of the segment."""

    response_format: str
    sample_rate: int
    speed: float = 1.0
    streaming: bool = True


def check_session(synth: Synthesizer, fields: SpeechFields, response_format: str) -> int:
    """Validate a session's fields once, before any text: the errors a config can cause (model,
    task, voice, reference, format) come at once, not with the first segment. Returns the rate."""
    job = synth.validate(replace(fields, text="."))
    check_output_format(response_format, job.sample_rate)
    return job.sample_rate


async def open_segment(
    synth: Synthesizer, fields: SpeechFields, text: str, request_id: str, protocol: str
) -> SynthesisStream:
    """Validate, admit and start one segment (its errors before audio raise here)."""
    try:
        job = synth.validate(replace(fields, text=text, request_id=request_id))
    except Exception as exc:
        synth.reject(protocol, exc)
        raise
    return await synth.open(job, protocol)


async def encoded_audio(stream: SynthesisStream, audio: SegmentAudio) -> AsyncIterator[bytes]:
    """The segment's encoded audio; the caller closes `stream`."""
    encoder = make_encoder(audio.response_format, audio.sample_rate, streaming=audio.streaming)
    resampler = Resampler(24000, audio.sample_rate, audio.speed)
    async for event in stream:
        if isinstance(event, AudioPiece):
            data = encoder.push(resampler.push(event.pcm))
            if data:
                yield data
                stream.first_byte_sent()
    tail = encoder.push(resampler.flush()) + encoder.finish()
    if tail:
        yield tail
        stream.first_byte_sent()
