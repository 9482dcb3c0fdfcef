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
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from qtts.request import request_limits as lim
from qtts.request.errors import InvalidArgument

from .audio_encoding import check_output_format
from .audio_output import AudioOutput
from .core import GatewayCore, SynthesisStream
from .job import SpeechFields, SynthesisJob

GRANULARITIES = ("sentence", "clause", "none")
# Abbreviation-prone ASCII marks end a unit only when whitespace follows; the CJK (and Devanagari,
# Arabic) marks are never abbreviations and end one at once.
_ASCII_SENTENCE = frozenset(".!?")
_SCRIPT_SENTENCE = frozenset("。！？…।॥؟")
_ASCII_CLAUSE = frozenset(",;:")
_SCRIPT_CLAUSE = frozenset("，；、،")
# Closing quotes and brackets right after a mark belong to the unit it ends.
_CLOSERS = frozenset("\"')]}”’»」』）")
_SPACES = re.compile(r"\s*")


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
        self._marks = _marks_pattern(frozenset(ascii_marks), frozenset(script_marks))
        self.reset()

    @property
    def open(self) -> bool:
        """Whether the current segment has text (a segment never starts with whitespace)."""
        return bool(self._seg)

    def reset(self) -> None:
        self._seg = ""  # the current segment's text so far
        self._sent = 0  # of which handed on
        self._scanned = 0  # no boundary before this index

    def feed(self, text: str) -> list[TextPiece]:
        """The pieces `text` makes. Linear in the text: every character is scanned once, and the
        text is copied once (a 15 MB piece cut into thousands of segments costs what its length
        does; a rescan from each segment's start made it quadratic)."""
        buf = self._seg + text if self._seg else text.lstrip()
        start, sent, scanned = 0, self._sent, self._scanned  # the segment is buf[start:]
        end = len(buf.rstrip()) if self.max_chars and len(buf) > self.max_chars else len(buf)
        pieces = []
        ahead = None  # a unit's end found beyond the length limit: segments of it come first
        while True:
            if ahead is None:
                cut = self._boundary(buf, scanned)
                scanned = cut if cut is not None else self._scan_stop
            else:
                cut = ahead
            long = self._overlong_cut(buf, start, sent, end if cut is None else cut)
            ahead, cut = (cut, long) if long is not None else (None, cut)
            if cut is None:
                break
            pieces.append(TextPiece(buf[sent:cut], end=True))
            start = _skip_space(buf, cut)
            sent, scanned = start, max(start, scanned)
        if len(buf) > sent:
            pieces.append(TextPiece(buf[sent:]))
            sent = len(buf)
        self._seg = buf[start:] if start else buf
        self._sent, self._scanned = sent - start, scanned - start
        return pieces

    def flush(self) -> list[TextPiece]:
        """The rest of the text; the current segment ends (nothing when it has no text)."""
        pieces = self.feed("")
        if self.open:
            pieces.append(TextPiece("", end=True))
        self.reset()
        return pieces

    def _boundary(self, buf: str, i: int) -> int | None:
        """The end of the first unit (sentence, clause) in `buf` from index `i`, or None; where
        the scan stopped in `_scan_stop` (no boundary before it)."""
        self._scan_stop = len(buf)
        if self._marks is None:
            return None
        m = self._marks.search(buf, i)
        if m is None:
            return None
        if m.lastgroup == "pending":  # an ASCII mark at the end: a space may still come ("3.14")
            self._scan_stop = m.start()
            return None
        return m.end()

    def _overlong_cut(self, buf: str, start: int, sent: int, end: int) -> int | None:
        """Where a segment `buf[start:]` longer than `max_chars` (trailing whitespace aside: `end`
        is where it ends) is cut: at its last space below the limit, never before `sent`."""
        if not self.max_chars or end - start <= self.max_chars:
            return None
        cut = buf.rfind(" ", start, start + self.max_chars + 1)
        if cut < sent:  # text handed on stays in this segment
            cut = sent
        return cut if cut > start else start + self.max_chars


def _skip_space(buf: str, i: int) -> int:
    """The index of the first non-whitespace character of `buf` from `i` (len(buf) if none)."""
    return _SPACES.match(buf, i).end()


def _marks_pattern(ascii_marks: frozenset[str], script_marks: frozenset[str]) -> re.Pattern | None:
    """Where a unit ends: a script mark (and its closers), an ASCII mark and its closers before
    whitespace; `pending`: an ASCII mark and closers at the end of the text so far."""
    if not ascii_marks and not script_marks:
        return None

    def chars(marks: frozenset[str]) -> str:
        return "[" + "".join(re.escape(c) for c in sorted(marks)) + "]"

    closers = chars(_CLOSERS) + "*"
    ends = [f"{chars(script_marks)}{closers}"] if script_marks else []
    if ascii_marks:
        ends.append(f"{chars(ascii_marks)}{closers}(?=\\s)")
        ends.append(f"(?P<pending>{chars(ascii_marks)}{closers}\\Z)")
    return re.compile("|".join(ends))


class TextBudget:
    """The bounds on streamed text, checked on each piece before any work is done with it: at
    most `max_piece` characters a piece, `max_utterance` an utterance, and valid Unicode (no lone
    UTF-16 surrogate, which has no UTF-8 encoding). A refused piece is not counted: the
    session goes on without it."""

    def __init__(self, max_piece: int, max_utterance: int, param: str = "text"):
        self.max_piece, self.max_utterance, self.param = max_piece, max_utterance, param
        self.used = 0  # characters the current utterance took

    def take(self, text: str) -> None:
        """Count `text` against the bounds, or raise InvalidArgument naming the field."""
        if len(text) > self.max_piece:
            raise InvalidArgument(
                f"{self.param} is {len(text)} characters long; the limit for one piece is {self.max_piece} characters",
                param=self.param,
            )
        if self.used + len(text) > self.max_utterance:
            raise InvalidArgument(
                f"{self.param} would make the utterance {self.used + len(text)} characters long; the limit "
                f"is {self.max_utterance} (end the utterance to go on)",
                param=self.param,
            )
        if lim.has_surrogate(text):
            raise InvalidArgument(
                f"{self.param} contains a lone UTF-16 surrogate (not valid Unicode text)", param=self.param
            )
        self.used += len(text)

    def reset(self) -> None:
        """A new utterance."""
        self.used = 0


class SegmentText:
    """One segment's text on its way to the talker: appended by the receiver, read by the request.

    `first()` is the text the request starts with; `rest()` yields the later text as
    (text, final) for talker.v1 GenerateStream, what piled up meanwhile in one piece. The pieces
    are kept as a list, joined when read, so many small pieces cost their length, not its square."""

    def __init__(self) -> None:
        self.closed = False
        self._parts: list[str] = []
        self._joined = ("", 0)  # `text` as of that many parts
        self._has_words = False  # some non-whitespace text
        self._taken = 0  # parts handed to the request
        self._changed = asyncio.Event()

    @property
    def text(self) -> str:
        """All of it so far."""
        if self._joined[1] != len(self._parts):
            self._joined = ("".join(self._parts), len(self._parts))
        return self._joined[0]

    def append(self, text: str) -> None:
        if text and not self.closed:
            self._parts.append(text)
            self._has_words = self._has_words or not text.isspace()
            self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def first(self) -> str:
        while not self._has_words and not self.closed:
            await self._wait()
        self._taken = len(self._parts)
        return self.text

    async def whole(self) -> str:
        """All the text, once the segment ended."""
        while not self.closed:
            await self._wait()
        self._taken = len(self._parts)
        return self.text

    async def rest(self) -> AsyncIterator[tuple[str, bool]]:
        while True:
            if self._taken < len(self._parts) or self.closed:
                piece, self._taken = "".join(self._parts[self._taken :]), len(self._parts)
                yield piece, self.closed
                if self.closed and self._taken == len(self._parts):
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


def check_session(synth: GatewayCore, fields: SpeechFields, response_format: str) -> SynthesisJob:
    """Validate a session's fields (`text` None: the text comes later) once, before any text: the
    errors a config can cause (model, task, voice, reference, format) come at once, not with the
    first segment. Returns the session's job (its rate, its ignored fields); each segment is then
    validated as a request of its own, with its text."""
    job = synth.validate(fields)
    check_output_format(response_format, job.sample_rate)
    return job


async def open_segment(
    synth: GatewayCore, fields: SpeechFields, text: SegmentText, request_id: str, protocol: str
) -> SynthesisStream:
    """Validate, admit and start one segment's talker request with its first text, the rest
    appended as it arrives (its errors before audio raise here). With the non-streaming text
    prompt (`streaming_text` false: the model sees all the text up front) the request waits for
    the segment's whole text."""
    whole = fields.streaming_text is False
    first = await (text.whole() if whole else text.first())
    follows = not (whole or text.closed)
    try:
        job = synth.validate(replace(fields, text=first, request_id=request_id, text_follows=follows))
    except Exception as exc:
        synth.reject(protocol, exc)
        raise
    return await synth.open(job, protocol, text=text.rest() if follows else None)
