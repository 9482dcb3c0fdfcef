"""The text-in WebSocket `/v1/audio/speech/stream` (vLLM-Omni's streaming speech protocol)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from websockets.sync.client import connect


@dataclass(frozen=True)
class WsAudio:
    """Binary audio of the segment `sentence_index` of utterance `utterance_index`."""

    data: bytes
    utterance_index: int
    sentence_index: int


@dataclass(frozen=True)
class WsEvent:
    """A JSON event: audio.start, audio.done, session.done or error (`body` holds all its fields)."""

    type: str
    body: dict[str, Any]


def stream_text_ws(url: str, texts: Iterable[str], **config: Any) -> Iterator[WsAudio | WsEvent]:
    """Send `session.config` (`config`: voice, response_format, stream_audio, ...), then each piece
    of `texts` as `input.text` from a background thread while events and audio come back; after
    the last piece `input.done`. Ends after the utterance's session.done, closing the session."""
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.config", **config}))
        failure: list[BaseException] = []

        def send() -> None:
            try:
                for piece in texts:
                    ws.send(json.dumps({"type": "input.text", "text": piece}))
                ws.send(json.dumps({"type": "input.done"}))
            except BaseException as exc:  # noqa: BLE001 - reported to the reader below
                failure.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        where = (0, 0)
        while True:
            msg = ws.recv()
            if isinstance(msg, bytes):
                yield WsAudio(msg, *where)
                continue
            body = json.loads(msg)
            if body.get("type") == "audio.start":
                where = (body["utterance_index"], body["sentence_index"])
            yield WsEvent(body.get("type", ""), body)
            if body.get("type") == "session.done":
                break
        sender.join()
        if failure:
            raise failure[0]
        ws.send(json.dumps({"type": "session.close"}))
