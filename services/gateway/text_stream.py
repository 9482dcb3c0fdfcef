"""Text streamed in (WebSocket and gRPC): the text cut into segments, each segment one running
talker request that takes its text as it arrives.

A segment is an utterance (the text up to `input.done` / flush / the end of input) unless the
session asks to cut at sentence or clause ends, and never longer than `--max-input-chars`. Its
talker request starts with the first piece and gets every later piece appended (talker.v1
GenerateStream): the talker feeds one text token per frame and, when the text runs dry before
the segment ends, the stream waits instead of ending its speech. So audio for the first words
starts before the text is complete, with one prefill per segment and prosody that carries
across the pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from .audio_encoding import check_output_format
from .audio_output import AudioOutput
from .core import GatewayCore, SynthesisStream
from .job import SpeechFields

GRANULARITIES = ("sentence", "clause", "none")
# Abbreviation-prone ASCII marks end a unit only when whitespace follows; the CJK (and Devanagari,
# Arabic) marks are never abbreviations and end one at once.
_ASCII_SENTENCE = frozenset(".!?")
_SCRIPT_SENTENCE = frozenset("。！？…।॥؟")
_ASCII_CLAUSE = frozenset(",;:")
_SCRIPT_CLAUSE = frozenset("，；、،")
# Closing quotes and brackets right after a mark belong to the unit it ends.
_CLOSERS = frozenset("\"')]}”’»」』）")


@dataclass(frozen=True)
class TextPiece:
    """Text for the current segment (maybe empty); `end`: the segment ends after it."""

    text: str
    end: bool = False


class TextSplitter:
    """Hands incoming text on as soon as it arrives, marking where segments end (pure, no I/O).

    A segment's leading whitespace is dropped; the rest goes on as is, whitespace too (it tells
    the talker that the word before it is complete; the talker drops whitespace at the very end of
    a segment, as a whole text is stripped). With `sentence` / `clause` a segment ends after
    a sentence (clause) mark; with `none` only at `flush`. A segment reaching `max_chars` ends at its
    last space below the limit, so no segment is ever refused as too long.
    """

    def __init__(self, granularity: str = "none", max_chars: int = 0):
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
        self.reset()

    @property
    def open(self) -> bool:
        """Whether the current segment has text."""
        return bool(self._seg.strip())

    def reset(self) -> None:
        self._seg = ""  # the current segment's text so far
        self._sent = 0  # of which handed on
        self._scanned = 0  # no boundary before this index

    def feed(self, text: str) -> list[TextPiece]:
        self._seg += text if self._seg else text.lstrip()
        pieces = []
        while True:
            cut = self._boundary()
            if cut is None:
                cut = self._overlong_cut()
            if cut is None:
                break
            pieces.append(TextPiece(self._seg[self._sent : cut], end=True))
            self._seg, self._sent, self._scanned = self._seg[cut:].lstrip(), 0, 0
        if len(self._seg) > self._sent:
            pieces.append(TextPiece(self._seg[self._sent :]))
            self._sent = len(self._seg)
        return pieces

    def flush(self) -> list[TextPiece]:
        """The rest of the text; the current segment ends (nothing when it has no text)."""
        pieces = self.feed("")
        if self.open:
            pieces.append(TextPiece("", end=True))
        self.reset()
        return pieces

    def _boundary(self) -> int | None:
        """The end of the first unit (sentence, clause) in the segment, or None."""
        buf, i = self._seg, self._scanned
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
            self._scanned = j
            return j
        self._scanned = i
        return None

    def _overlong_cut(self) -> int | None:
        if not self.max_chars or len(self._seg.rstrip()) <= self.max_chars:
            return None
        cut = self._seg.rfind(" ", 0, self.max_chars + 1)
        if cut < self._sent:  # text handed on stays in this segment
            cut = self._sent
        return cut if cut > 0 else self.max_chars


class SegmentText:
    """One segment's text on its way to the talker: appended by the receiver, read by the request.

    `first()` is the text the request starts with; `rest()` yields the later text as
    (text, final) for talker.v1 GenerateStream, what piled up meanwhile in one piece."""

    def __init__(self) -> None:
        self.text = ""  # all of it so far
        self.closed = False
        self._taken = 0
        self._changed = asyncio.Event()

    def append(self, text: str) -> None:
        if text and not self.closed:
            self.text += text
            self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def first(self) -> str:
        while not self.text.strip() and not self.closed:
            await self._wait()
        self._taken = len(self.text)
        return self.text

    async def whole(self) -> str:
        """All the text, once the segment ended."""
        while not self.closed:
            await self._wait()
        self._taken = len(self.text)
        return self.text

    async def rest(self) -> AsyncIterator[tuple[str, bool]]:
        while True:
            if self._taken < len(self.text) or self.closed:
                piece, self._taken = self.text[self._taken :], len(self.text)
                yield piece, self.closed
                if self.closed and self._taken == len(self.text):
                    return
                continue
            await self._wait()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


@dataclass(frozen=True)
class SegmentAudio:
    """How a segment's audio is encoded: `streaming` hands out bytes as they are produced; otherwise
    one complete file comes at the end of the segment."""

    response_format: str
    sample_rate: int
    speed: float = 1.0
    streaming: bool = True

    def output(self) -> AudioOutput:
        return AudioOutput(self.response_format, self.sample_rate, self.speed, self.streaming)


def check_session(synth: GatewayCore, fields: SpeechFields, response_format: str) -> int:
    """Validate a session's fields once, before any text: the errors a config can cause (model,
    task, voice, reference, format) come at once, not with the first segment. Returns the rate."""
    job = synth.validate(replace(fields, text="."))
    check_output_format(response_format, job.sample_rate)
    return job.sample_rate


async def open_segment(
    synth: GatewayCore, fields: SpeechFields, text: SegmentText, request_id: str, protocol: str
) -> SynthesisStream:
    """Validate, admit and start one segment's talker request with its first text, the rest
    appended as it arrives (its errors before audio raise here). With the non-streaming text
    prompt (`streaming_text` false: the model sees all the text up front) the request waits for
    the segment's whole text."""
    whole = fields.streaming_text is False
    first = await (text.whole() if whole else text.first())
    try:
        job = synth.validate(replace(fields, text=first, request_id=request_id))
    except Exception as exc:
        synth.reject(protocol, exc)
        raise
    if whole or text.closed:
        return await synth.open(job, protocol)
    # As received: validation strips the text, and a space at its end belongs to the next word.
    return await synth.open(replace(job, text=first), protocol, text=text.rest())
