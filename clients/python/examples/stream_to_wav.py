"""Stream a clip over gRPC into a WAV file, writing each chunk as it arrives.

python examples/stream_to_wav.py --voice demo --text "Hello there." --out hello.wav
"""

from __future__ import annotations

import argparse

from qwen3_tts_client import Audio, SynthesisOptions, TTSClient


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--text", default="Hello from the Qwen3-TTS client.")
    p.add_argument("--voice", default="demo")
    p.add_argument("--max-new-frames", type=int, default=0, help="0: from the text length")
    p.add_argument("--out", default="out.wav")
    args = p.parse_args()
    options = SynthesisOptions(voice=args.voice, encoding="wav", max_new_frames=args.max_new_frames)
    with TTSClient(args.address) as client, open(args.out, "wb") as f:
        for event in client.synthesize(args.text, options):
            if isinstance(event, Audio):
                f.write(event.data)  # the first chunk starts with a streaming WAV header
            else:
                print(f"{args.out}: {event.num_samples / event.sample_rate_hz:.2f} s, {event.finish_reason}")


if __name__ == "__main__":
    main()
