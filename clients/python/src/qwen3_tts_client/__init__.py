"""Client of the Qwen3-TTS streaming server.

`TTSClient` wraps the tts.v1 gRPC API (stubs generated from `protos/` when the package is built):
`synthesize` for text known up front, `streaming_synthesize` for text that arrives in pieces.
`stream_text_ws` speaks the text-in WebSocket protocol of `/v1/audio/speech/stream`.
`tts_pb2` and `tts_pb2_grpc` are the generated stubs themselves, for calling the API directly.
"""

from ._proto import tts_pb2, tts_pb2_grpc
from .grpc_client import (
    Audio,
    SegmentStart,
    Summary,
    SynthesisOptions,
    TTSClient,
    TTSError,
    WordTimestamp,
)
from .websocket_client import WsAudio, WsEvent, stream_text_ws

__all__ = [
    "Audio",
    "SegmentStart",
    "Summary",
    "SynthesisOptions",
    "TTSClient",
    "TTSError",
    "WordTimestamp",
    "WsAudio",
    "WsEvent",
    "stream_text_ws",
    "tts_pb2",
    "tts_pb2_grpc",
]
