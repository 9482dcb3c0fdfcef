"""How many refusals a second one gateway process answers, and what each costs it (issue #26).

A closed loop past capacity turns into a refusal storm: every refused worker sends again at once.
Here the stand-in talker publishes no room at all (benchmarks/refusal_latency.py's stack with
`--room 0`), so the gateway refuses every `POST /v1/audio/speech` on its headers, and
`--connections` raw keep-alive connections send voice clones (a 3 s clip, ~190 KB of JSON, unless
`--no-clip`) as fast as the answers come. The gateway's CPU while they do says whether it, not the
sender, was the limit (1.0 = one full core: its one event loop).

    python -m benchmarks.refusal_storm --out run/storm --connections 32 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from benchmarks.reference_audio import audio_data_url, synthetic_reference_wav
from benchmarks.refusal_latency import cpu_seconds, room_stack


def request_bytes(clip: bool) -> bytes:
    """One voice-clone POST, headers and body, as HTTP/1.1 bytes."""
    body = {"input": "Hello there.", "task_type": "voice_clone", "ref_text": "A reference clip."}
    if clip:
        body["ref_audio"] = audio_data_url(synthetic_reference_wav(3.0))
    raw = json.dumps(body).encode()
    head = (
        b"POST /v1/audio/speech HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(raw)
    )
    return head + raw


async def storm(host: str, port: int, connections: int, seconds: float, request: bytes) -> dict:
    """`connections` loops of send-request, read-answer until `seconds` are over."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    stop = time.perf_counter() + seconds

    async def one_connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        while time.perf_counter() < stop:
            t = time.perf_counter()
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - t)
            status = head[9:12].decode()
            statuses[status] = statuses.get(status, 0) + 1
        writer.close()

    await asyncio.gather(*(one_connection() for _ in range(connections)))
    ms = np.asarray(latencies) * 1e3
    return {
        "answers_per_s": round(len(latencies) / seconds, 1),
        "statuses": statuses,
        "latency_ms": {f"p{q}": round(float(np.percentile(ms, q)), 2) for q in (50, 95, 99)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.refusal_storm", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--no-clip", action="store_true", help="bodies without a reference clip")
    p.add_argument("--gateway-args", default="--max-streams 1024")
    args = p.parse_args(argv)
    # The stack's talker: no room, so every request is refused; the rest as refusal_latency's.
    args.room, args.frames, args.speedup, args.lead_s = 0, 125, 4.0, 4.0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with room_stack(out, args) as (url, gateway_pid, _, _grpc):
        where = urlsplit(url)
        time.sleep(0.5)  # a capacity poll or more: the pool knows there is no room
        cpu0, t0 = cpu_seconds(gateway_pid), time.perf_counter()
        result = asyncio.run(
            storm(where.hostname, where.port, args.connections, args.seconds, request_bytes(not args.no_clip))
        )
        result["gateway_cores"] = round((cpu_seconds(gateway_pid) - cpu0) / (time.perf_counter() - t0), 3)
    result["gateway_us_per_answer"] = round(result["gateway_cores"] / result["answers_per_s"] * 1e6, 1)
    print(json.dumps(result))
    (out / "storm.json").write_text(json.dumps({"args": vars(args), "result": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
