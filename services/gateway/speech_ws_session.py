"""One `/v1/audio/speech/stream` WebSocket connection's state (speech_ws.py): its configuration,
its text on its way into segments, the queue of segments and utterance ends its worker runs,
token usage per utterance, and sends watched by the write timeout."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.websockets import WebSocket

from qtts.request.errors import Cancelled, openai_error_body, retry_after_ms

from .core import GatewayCore
from .http_request import StreamingSessionConfig
from .job import SpeechFields
from .text_stream import SegmentAudio, SegmentText, TextBudget, TextPiece, TextSplitter
from .validation import new_request_id


class StalledClient(Cancelled):
    """A send did not complete within the write timeout: the client stopped reading."""


@dataclass(frozen=True)
class Segment:
    """One segment of an utterance: its text as it arrives, its typed request (without the text)
    and how its audio is encoded."""

    utterance: int
    index: int
    text: SegmentText
    fields: SpeechFields
    audio: SegmentAudio


@dataclass
class UtteranceEnd:
    """The end of an utterance in the queue: its session.done goes out after its segments."""

    utterance: int
    total: int
    cancelled: bool = False


@dataclass
class Close:
    """session.close in the queue: the worker stops once what was sent before it is done."""


@dataclass
class Usage:
    """An utterance's tokens: text in, codec frames out."""

    input_tokens: int = 0
    output_tokens: int = 0

    def to_json(self) -> dict:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.input_tokens + self.output_tokens,
        }


@dataclass
class Session:
    """One connection's state, shared by its receiver and its worker."""

    ws: WebSocket
    synth: GatewayCore
    session_id: str = field(default_factory=new_request_id)
    config: StreamingSessionConfig | None = None
    fields: SpeechFields | None = None
    audio: SegmentAudio | None = None
    splitter: TextSplitter = field(default_factory=TextSplitter)
    budget: TextBudget = field(default_factory=lambda: TextBudget(0, 0))
    utterance: int = 0  # the utterance that takes input.text now
    sentences: int = 0  # segments cut from it so far
    segment: Segment | None = None  # the segment that takes input.text now
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    current: asyncio.Task | None = None
    current_utterance: int = -1
    usage: dict[int, Usage] = field(default_factory=dict)
    # Seconds of the talker's audio sent per utterance so far: where its next segment starts.
    spoken_s: dict[int, float] = field(default_factory=dict)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A send that does not complete this long ends the session (0 = never); see `_send`.
    write_timeout_s: float = 0.0
    stalled: list[StalledClient] = field(default_factory=list)

    @property
    def utterance_open(self) -> bool:
        return self.sentences > 0 or self.splitter.open

    @property
    def idle(self) -> bool:
        """Nothing to synthesise but what the client has still to send (a segment in flight that
        waits for its text is the client's to continue)."""
        return self.queue.empty() and (self.current is None or self.segment is not None)

    def route(self, pieces: list[TextPiece]) -> None:
        """Text into the open segment (a new one, queued, for the first text after an end)."""
        for piece in pieces:
            if piece.text:
                if self.segment is None or self.segment.text.closed:  # ended early: failed, or at its length
                    self.segment = Segment(
                        self.utterance, self.sentences, SegmentText(), self.fields, self.audio
                    )
                    self.queue.put_nowait(self.segment)
                    self.sentences += 1
                self.segment.text.append(piece.text)
            if piece.end and self.segment is not None:
                self.segment.text.close()
                self.segment = None

    def end_utterance(self, cancelled: bool = False) -> None:
        """End the open utterance: its text flushed into segments (dropped when `cancelled`), its
        session.done queued after them."""
        if not cancelled:
            self.route(self.splitter.flush())
        if self.segment is not None:
            self.segment.text.close()
            self.segment = None
        self.queue.put_nowait(UtteranceEnd(self.utterance, self.sentences, cancelled))
        self.budget.reset()
        self.utterance += 1
        self.sentences = 0

    def cancel(self) -> None:
        """Drop the buffered text and every queued segment, cut the one in flight. The open utterance
        ends at once, and every utterance that loses audio still gets its session.done, marked
        cancelled (the acknowledgement of the cancel)."""
        self.splitter.reset()
        kept = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, UtteranceEnd):
                item.cancelled = True
                kept.append(item)
            elif isinstance(item, Segment):
                item.text.close()
        for item in kept:
            self.queue.put_nowait(item)
        if self.current is not None:
            self.current.cancel()
        self.end_utterance(cancelled=True)

    async def send_json(self, payload: dict) -> None:
        await self._send(self.ws.send_json, payload)

    async def send_bytes(self, data: bytes) -> None:
        await self._send(self.ws.send_bytes, data)

    async def _send(self, send, data) -> None:
        # A send blocks while the client's TCP window is full: a listener that never reads would
        # hold its stream and admission slot for good. Once one send stalls, every later one
        # fails at once (the connection is unusable), so the session ends without more waiting.
        if self.stalled:
            raise self.stalled[0]
        async with self.send_lock:
            if self.write_timeout_s <= 0:
                await send(data)
                return
            try:  # asyncio.timeout: wait_for can swallow a cancel (http_streaming.py)
                async with asyncio.timeout(self.write_timeout_s):
                    await send(data)
            except TimeoutError:
                self.stalled.append(StalledClient(f"the client took no audio for {self.write_timeout_s:g} s"))
                raise self.stalled[0] from None

    async def send_error(self, exc: BaseException, **context) -> None:
        """An `error` event; a refusal that knows when room is expected also says when to try
        again (`retry_after_ms`, spread as HTTP's `retry-after-ms` is)."""
        body = openai_error_body(exc)["error"]
        retry_after_s = getattr(exc, "retry_after_s", None)
        hint = {"retry_after_ms": retry_after_ms(retry_after_s)} if retry_after_s else {}
        await self.send_json(
            {
                "type": "error",
                "message": body["message"],
                "code": body["code"],
                "param": body["param"],
                **hint,
                **context,
            }
        )
