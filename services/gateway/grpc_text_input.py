"""The request stream of `tts.v1` StreamingSynthesize: the first message's config, then text
messages routed into segments (text_stream.py) on a queue that the servicer synthesises from,
with the idle timeout of a silent client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from qtts.pb import tts_pb2
from qtts.request.errors import Cancelled, InvalidArgument, RequestTimeout

from .text_stream import SegmentText, TextBudget, TextPiece, TextSplitter

TEXT_SPLITS = {
    tts_pb2.TEXT_SPLIT_UNSPECIFIED: "none",
    tts_pb2.TEXT_SPLIT_SENTENCE: "sentence",
    tts_pb2.TEXT_SPLIT_CLAUSE: "clause",
    tts_pb2.TEXT_SPLIT_NONE: "none",
}
# The end of a StreamingSynthesize call's input, in its segment queue.
END_OF_INPUT = object()


async def next_request(
    requests: AsyncIterator[tts_pb2.StreamingSynthesizeRequest],
    idle_timeout_s: float,
    idle: Callable[[], bool] = lambda: True,
) -> tts_pb2.StreamingSynthesizeRequest | None:
    """The next request message (None at the end of input). A client that sends nothing for
    `idle_timeout_s` while `idle()` (nothing is being synthesised, or the synthesis waits for its
    text) ends the call with RequestTimeout, as the WebSocket closes such a session; 0: never."""
    if idle_timeout_s <= 0:
        return await anext(requests, None)
    receive = asyncio.ensure_future(anext(requests, None))
    try:
        while True:
            done, _ = await asyncio.wait({receive}, timeout=idle_timeout_s)
            if done:
                return receive.result()
            if idle():
                raise RequestTimeout(f"no message within {idle_timeout_s:g} s; closing")
    finally:
        if not receive.done():
            receive.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receive


async def first_config(
    requests: AsyncIterator[tts_pb2.StreamingSynthesizeRequest], idle_timeout_s: float = 0.0
):
    first = await next_request(requests, idle_timeout_s)
    if first is None or not first.HasField("streaming_config"):
        raise InvalidArgument(
            "the first StreamingSynthesizeRequest must carry streaming_config", param="streaming_config"
        )
    return first.streaming_config


async def read_text(
    requests: AsyncIterator[tts_pb2.StreamingSynthesizeRequest],
    splitter: TextSplitter,
    budget: TextBudget,
    queue: asyncio.Queue,
    idle_timeout_s: float = 0.0,
    busy: Callable[[], bool] = lambda: False,
) -> None:
    """Route the incoming text into segments (each queued when its first text arrives, and fed
    the rest as it comes), then the end of input (or the error) onto `queue`. Each piece is held
    to `budget` (an utterance ends at each flush) before it is looked at. `busy()`: whether a
    segment is being synthesised (the idle clock does not run then)."""
    segment: SegmentText | None = None

    def route(pieces: list[TextPiece]) -> None:
        nonlocal segment
        for piece in pieces:
            if piece.text:
                if segment is None or segment.closed:  # ended early: at its length
                    segment = SegmentText()
                    queue.put_nowait(segment)
                segment.append(piece.text)
            if piece.end and segment is not None:
                segment.close()
                segment = None

    def idle() -> bool:
        # Nothing queued, and nothing synthesised but what waits for the client's text.
        return queue.empty() and (not busy() or (segment is not None and not segment.closed))

    try:
        while (req := await next_request(requests, idle_timeout_s, idle)) is not None:
            if not req.HasField("input"):
                raise InvalidArgument(
                    "streaming_config is only allowed in the first message", param="streaming_config"
                )
            budget.take(req.input.text)
            route(splitter.feed(req.input.text))
            if req.input.flush:
                route(splitter.flush())
                budget.reset()
        route(splitter.flush())
        queue.put_nowait(END_OF_INPUT)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # A protocol error, or the client's side of the call broke (it cancelled, or its stream
        # failed): the segment in flight ends with the text it has, then the call with the error.
        if segment is not None:
            segment.close()
        failed = Cancelled(f"the request stream ended with an error: {type(exc).__name__}")
        queue.put_nowait(exc if isinstance(exc, InvalidArgument | RequestTimeout) else failed)
