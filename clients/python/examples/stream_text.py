"""Stream text from a token generator (a stand-in for an LLM) and play it as it is spoken, over the
WebSocket or over gRPC: one running synthesis takes the text as it comes; each segment's audio
(one per sentence with --split sentence) is written to its own raw PCM file.

    python examples/stream_text.py --transport ws --voice demo
    python examples/stream_text.py --transport grpc --voice demo
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from qwen3_tts_client import (
    Audio,
    SegmentStart,
    SynthesisOptions,
    TTSClient,
    WsAudio,
    WsEvent,
    stream_text_ws,
)

TEXT = "Hello there. This audio started before the text was complete. Goodbye!"


def tokens(delay_s: float) -> Iterator[str]:
    for word in TEXT.split(" "):
        time.sleep(delay_s)
        yield word + " "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=("ws", "grpc"), default="ws")
    p.add_argument("--http", default="127.0.0.1:8000", help="gateway HTTP host:port (WebSocket)")
    p.add_argument("--address", default="127.0.0.1:50051", help="gateway gRPC host:port")
    p.add_argument("--voice", default="demo")
    p.add_argument("--max-new-frames", type=int, default=0, help="per segment; 0: from the text length")
    p.add_argument(
        "--split", choices=("none", "sentence", "clause"), default="none", help="where segments end"
    )
    p.add_argument("--delay-s", type=float, default=0.05, help="between tokens")
    p.add_argument("--prefix", default="segment")
    args = p.parse_args()
    started = time.perf_counter()
    files: dict[int, bytes] = {}
    if args.transport == "ws":
        config = {
            "voice": args.voice,
            "response_format": "pcm",
            "stream_audio": True,
            "split_granularity": args.split,
        }
        if args.max_new_frames:
            config["max_new_tokens"] = args.max_new_frames
        for event in stream_text_ws(
            f"ws://{args.http}/v1/audio/speech/stream", tokens(args.delay_s), **config
        ):
            if isinstance(event, WsAudio):
                files[event.sentence_index] = files.get(event.sentence_index, b"") + event.data
            elif isinstance(event, WsEvent) and event.type == "audio.start":
                print(f"{time.perf_counter() - started:5.2f} s  speaking: {event.body['sentence_text']}")
            elif isinstance(event, WsEvent) and event.type == "error":
                raise SystemExit(f"error: {event.body['message']}")
    else:
        options = SynthesisOptions(voice=args.voice, max_new_frames=args.max_new_frames)
        with TTSClient(args.address) as client:
            for event in client.streaming_synthesize(tokens(args.delay_s), options, text_split=args.split):
                if isinstance(event, SegmentStart):
                    print(f"{time.perf_counter() - started:5.2f} s  speaking: {event.text}")
                elif isinstance(event, Audio):
                    files[event.segment_index] = files.get(event.segment_index, b"") + event.data
    for index, pcm in sorted(files.items()):
        name = f"{args.prefix}_{index}.pcm"
        open(name, "wb").write(pcm)
        print(f"{name}: {len(pcm) / 48000:.2f} s of PCM s16le at 24 kHz")


if __name__ == "__main__":
    main()
