"""WebSocket `/v1/audio/speech/stream`: text streamed in, audio streamed out, speaking vLLM-Omni's
streaming speech protocol so its clients work unmodified.

Client -> server (JSON text frames):
    {"type": "session.config", ...}      first message (StreamingSessionConfig); again between utterances
    {"type": "input.text", "text": "..."} the next piece of text
    {"type": "input.done"}               flush: finish the utterance, keep the session
    {"type": "input.cancel"}             stop now: drop queued text, cut the segment in flight
    {"type": "session.close"}            finish what was sent, then close

Server -> client:
    {"type": "audio.start", "utterance_index", "sentence_index", "sentence_text", "format", ...}
    binary frames: the segment's audio
    {"type": "audio.done", "utterance_index", "sentence_index", "sentence_text", "total_bytes", ...}
    {"type": "session.done", "utterance_index", "total_sentences", "usage", ...}  one per input.done
    {"type": "error", "message", "code", "param", ...}

A receiver reads messages and routes the text into segments (text_stream.py: by default one per
utterance, each one running talker request that takes its text as it arrives); a worker runs the
segments one after another, so audio starts with the first words while the rest is being written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from qtts.request.errors import InvalidArgument, TTSError, mapping_for
from qtts.request.vocabulary import NATIVE_SAMPLE_RATE

from .aligner_client import AlignerClient, check_alignable
from .audio_output import AudioOutput
from .core import GatewayCore, SynthesisStream
from .http_body import parse_json, validate_body
from .http_request import StreamingSessionConfig
from .speech_ws_session import Close, Segment, Session, StalledClient, Usage, UtteranceEnd
from .text_stream import (
    SegmentAudio,
    TextBudget,
    TextSplitter,
    check_session,
    open_segment,
)

log = logging.getLogger(__name__)

PROTOCOL = "websocket"
# A message's type where clients write it, first: {"type": "input.text", ...}.
_HEAD_TYPE = re.compile(r'\s*\{\s*"type"\s*:\s*"([a-z._]{1,32})"')
# Close codes (RFC 6455): normal, protocol error of the client, server error.
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_INTERNAL = 1000, 1008, 1011


class SpeechStreamEndpoint:
    """The `/v1/audio/speech/stream` handler: one `Session` per connection."""

    def __init__(
        self,
        synth: GatewayCore,
        config_timeout_s: float = 10.0,
        idle_timeout_s: float = 30.0,
        max_message_bytes: int = 32 << 20,
        write_timeout_s: float = 0.0,
        aligner: AlignerClient | None = None,
    ):
        self.synth = synth
        # The aligner stage; None: word_timestamps is refused.
        self.aligner = aligner
        self.write_timeout_s = write_timeout_s
        self.config_timeout_s = config_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_message_bytes = max_message_bytes

    async def __call__(self, ws: WebSocket) -> None:
        await ws.accept()
        session = Session(ws, self.synth, write_timeout_s=self.write_timeout_s)
        worker = asyncio.create_task(self._work(session))
        code = CLOSE_NORMAL
        try:
            code = await self._receive(session, worker)
            if code == CLOSE_NORMAL:
                await worker  # session.close: the worker finishes what was sent, then stops
        except WebSocketDisconnect:
            code = None
        except StalledClient as exc:
            # Its stream and slot are freed already (the segment's finally); one line, no traceback.
            log.info("speech stream %s closed: %s", session.session_id, exc.message)
            code = CLOSE_POLICY
        except Exception as exc:
            log.error("speech stream %s failed", session.session_id, exc_info=exc)
            code = CLOSE_INTERNAL
            with contextlib.suppress(Exception):
                await session.send_error(exc)
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker
            if code is not None and ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await ws.close(code)

    async def _receive(self, s: Session, worker: asyncio.Task) -> int:
        """Read messages until session.close (CLOSE_NORMAL) or a fatal client error (CLOSE_POLICY)."""
        while True:
            message = await self._next_message(s, worker)
            if message is None:
                return CLOSE_POLICY
            if message.get("type") == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            try:
                msg = parse_message(message, self.max_message_bytes, self.synth.limits.max_text_piece_chars)
            except InvalidArgument as exc:
                await s.send_error(exc)
                if s.config is None:
                    return CLOSE_POLICY
                continue
            kind = msg.get("type")
            if kind == "session.config":
                if not await self._configure(s, msg) and s.config is None:
                    return CLOSE_POLICY
            elif s.config is None:
                await s.send_error(
                    InvalidArgument(f"expected session.config first, got {kind!r}", param="type")
                )
                return CLOSE_POLICY
            elif kind == "input.text":
                text = msg.get("text", "")
                if not isinstance(text, str):
                    await s.send_error(InvalidArgument("input.text needs a string text", param="text"))
                    continue
                try:
                    s.budget.take(text)
                except InvalidArgument as exc:
                    self.synth.reject(PROTOCOL, exc)
                    await s.send_error(exc)
                    continue
                s.route(s.splitter.feed(text))
            elif kind == "input.done":
                s.end_utterance()
            elif kind == "input.cancel":
                s.cancel()
            elif kind == "session.close":
                if s.utterance_open:
                    s.end_utterance()
                s.queue.put_nowait(Close())
                return CLOSE_NORMAL
            else:
                await s.send_error(
                    InvalidArgument(
                        f"unknown message type {kind!r}; expected session.config, input.text, input.done, "
                        "input.cancel or session.close",
                        param="type",
                    )
                )

    async def _next_message(self, s: Session, worker: asyncio.Task) -> dict | None:
        """The next ASGI message; None (after an error event) when the client stayed silent too long.
        The idle clock runs only while nothing is being synthesised."""
        while True:
            timeout = self.config_timeout_s if s.config is None else self.idle_timeout_s
            receive = asyncio.ensure_future(s.ws.receive())
            # The worker ends early only when it fails (a client that stopped reading): that ends
            # the session at once, not at the next idle timeout.
            waiting = {receive} if worker.done() else {receive, worker}
            try:
                await asyncio.wait(waiting, timeout=timeout or None, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not receive.done():
                    receive.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await receive
            if not receive.cancelled():
                return receive.result()
            if worker.done():
                worker.result()  # a crashed worker ends the session with its error
            if s.config is not None and not s.idle:
                continue
            what = "session.config" if s.config is None else "a message"
            await s.send_error(InvalidArgument(f"no {what} within {timeout:g} s; closing"))
            return None

    async def _configure(self, s: Session, msg: dict) -> bool:
        """Apply a session.config; False (after an error event) when it is refused."""
        try:
            if s.utterance_open:
                raise InvalidArgument(
                    "session.config cannot change an utterance in progress; send input.done first",
                    param="type",
                )
            config = validate_body(StreamingSessionConfig, msg, "session.config")
            fields = config.to_fields(None)
            rate = check_session(self.synth, fields, config.response_format).sample_rate
            if config.word_timestamps:
                if self.aligner is None:
                    raise InvalidArgument(
                        "word_timestamps needs a forced aligner, which this server does not have",
                        param="word_timestamps",
                    )
                check_alignable(fields.language or "auto")
        except TTSError as exc:
            self.synth.reject(PROTOCOL, exc)
            self.synth.metrics.error(mapping_for(exc).grpc_code.name)
            await s.send_error(exc)
            return False
        s.config, s.fields = config, fields
        s.audio = SegmentAudio(config.response_format, rate, config.speed, config.stream_audio)
        limits = self.synth.limits
        s.splitter = TextSplitter(config.split_granularity, limits.max_input_chars)
        s.budget = TextBudget(limits.max_text_piece_chars, limits.max_utterance_chars)
        return True

    async def _work(self, s: Session) -> None:
        """Synthesise queued segments in order; send session.done at each utterance's end."""
        while True:
            item = await s.queue.get()
            if isinstance(item, Close):
                return
            if isinstance(item, UtteranceEnd):
                usage = s.usage.pop(item.utterance, Usage())
                s.spoken_s.pop(item.utterance, None)
                done = {
                    "type": "session.done",
                    "utterance_index": item.utterance,
                    "total_sentences": item.total,
                    "usage": usage.to_json(),
                }
                await s.send_json(done | ({"cancelled": True} if item.cancelled else {}))
                continue
            s.current_utterance = item.utterance
            s.current = asyncio.create_task(self._segment(s, item))
            try:
                await s.current
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # the session ends
            finally:
                s.current = None

    async def _timestamps(
        self, s: Session, seg: Segment, stream: SynthesisStream, output: AudioOutput
    ) -> list[dict] | None:
        """The segment's words, timed from the start of its utterance's audio."""
        pcm = b"".join(output.native_pcm)
        offset = s.spoken_s.get(seg.utterance, 0.0)
        s.spoken_s[seg.utterance] = offset + len(pcm) / 2 / NATIVE_SAMPLE_RATE
        return await self.aligner.try_align(
            stream.job.request_id,
            seg.text.text,
            stream.job.language,
            pcm,
            speed=seg.audio.speed,
            offset_s=offset,
        )

    async def _segment(self, s: Session, seg: Segment) -> None:
        """One segment: audio.start, its audio as binary frames, audio.done (also on failure)."""
        request_id = f"{s.session_id}-u{seg.utterance}-s{seg.index}"
        ids = {"utterance_index": seg.utterance, "sentence_index": seg.index}
        await s.send_json(
            {
                "type": "audio.start",
                **ids,
                "sentence_text": seg.text.text,  # the text so far: more may follow
                "format": seg.audio.response_format,
                "sample_rate": seg.audio.sample_rate,
                "channels": 1,
                "request_id": request_id,
            }
        )
        total, done, stream, error = 0, {"error": False}, None, None
        try:
            stream = await open_segment(self.synth, seg.fields, seg.text, request_id, PROTOCOL)
            align = s.config is not None and s.config.word_timestamps and self.aligner is not None
            a = seg.audio
            output = AudioOutput(a.response_format, a.sample_rate, a.speed, a.streaming, keep_native=align)
            async for chunk in output.chunks(stream):
                if chunk.data:
                    await s.send_bytes(chunk.data)
                    total += len(chunk.data)
            if align:
                done |= {"timestamps": await self._timestamps(s, seg, stream, output)}
            summary = stream.summary
            if summary is not None:
                usage = s.usage.setdefault(seg.utterance, Usage())
                usage.input_tokens += summary.num_input_tokens
                usage.output_tokens += summary.num_frames
                done |= {"finish_reason": summary.finish_reason, "num_frames": summary.num_frames}
        except asyncio.CancelledError as exc:
            error = exc
            done |= {"cancelled": True}
            raise
        except (WebSocketDisconnect, StalledClient) as exc:
            error = exc
            raise
        except Exception as exc:
            error = exc
            done = {"error": True}
            if not isinstance(exc, TTSError):
                log.error("segment %s failed", request_id, exc_info=exc)
            self.synth.metrics.error(mapping_for(exc).grpc_code.name)
            partial = {"partial_audio": True, "action": "discard"} if total else {}
            await s.send_error(exc, **ids, **partial)
        finally:
            if stream is not None:
                await stream.close(error)
            # Ended (maybe before its text did): the utterance's next text starts a new segment.
            seg.text.close()
            if not isinstance(error, WebSocketDisconnect):
                with contextlib.suppress(Exception):
                    await s.send_json(
                        {
                            "type": "audio.done",
                            **ids,
                            "sentence_text": seg.text.text,
                            "total_bytes": total,
                            **done,
                        }
                    )


def parse_message(message: dict, max_message_bytes: int, max_piece: int) -> dict:
    """The JSON object of a text message; a binary, overlong or malformed one is InvalidArgument."""
    raw = message.get("text")
    if raw is None:
        raise InvalidArgument("binary frames are not accepted; send JSON text messages")
    if len(raw) > max_message_bytes:
        raise InvalidArgument(f"message of {len(raw)} characters; the limit is {max_message_bytes}")
    _refuse_overlong_piece(raw, max_piece)
    msg = parse_json(raw, "message")
    if not isinstance(msg, dict):
        raise InvalidArgument("messages must be JSON objects")
    return msg


def _refuse_overlong_piece(raw: str, max_piece: int) -> None:
    """Refuse, unparsed, a message too long to be anything but a session.config (with its clip)
    that is not one: parsing 15 MB of JSON holds the event loop for a tenth of a second, and
    only to learn that its text is over the piece limit. Its type is read from its start
    (where clients write it); a message that does not even contain "session.config" cannot
    be one either."""
    # The longest JSON an input.text of max_piece characters takes: 12 per character (an
    # escaped surrogate pair) and room for the rest.
    if len(raw) <= 12 * max_piece + 4096:
        return
    head = _HEAD_TYPE.match(raw)
    kind = head.group(1) if head else None
    if kind == "session.config" or (kind is None and "session.config" in raw):
        return  # parsed, and held to its own limits
    raise InvalidArgument(
        f"a {len(raw)}-character {kind or 'message'} is refused unread: the limit for one piece "
        f"is {max_piece} characters",
        param="text" if kind in ("input.text", None) else None,
    )
