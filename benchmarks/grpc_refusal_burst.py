"""How long a burst of gRPC requests past the room takes to be refused by one gateway (issue #26).

A closed loop opens with every client at once; on the H200 and on the CPU harness the refusals of
that opening burst were the slow ones (`stack_summary`'s split: 0.8 s p50 for those sent in a
level's first second on the CPU harness, 2 ms after it). Here nothing else runs: the stand-in talker
of `benchmarks/refusal_latency.py` publishes `--room` streams (0: every request is refused on the
gateway's early check), the real gateway is in front of it, and `--processes` client processes
each open `--channels` channels and send their share of `--calls` Synthesize calls at one instant
(the same wall-clock start). Each call's latency, send to status, is recorded; the gateway's CPU
over the burst says whether it was busy or waiting.

    python -m benchmarks.grpc_refusal_burst --out run/burst --calls 768 --room 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.metrics import percentiles
from benchmarks.reference_audio import synthetic_reference_wav
from benchmarks.refusal_latency import cpu_seconds, room_stack


def _client(target: str, calls: int, channels: int, start_at: float, clip: bool, out: multiprocessing.Queue):
    """One client process: `calls` Synthesize calls over `channels` channels, all sent at
    `start_at` (wall clock); puts [(status, seconds)] on `out`."""
    import grpc

    from qtts.pb import tts_pb2, tts_pb2_grpc

    ref = synthetic_reference_wav(3.0) if clip else b""

    async def main() -> list[tuple[str, float]]:
        chans = [grpc.aio.insecure_channel(target) for _ in range(channels)]
        stubs = [tts_pb2_grpc.TextToSpeechServiceStub(c) for c in chans]
        for c in chans:
            await c.channel_ready()
        request = tts_pb2.SynthesizeRequest(
            text="Hello there.",
            task_type=tts_pb2.TASK_TYPE_VOICE_CLONE,
            reference_audio=ref,
            reference_text="A reference clip.",
            max_new_frames=125,
        )

        async def one(i: int) -> tuple[str, float]:
            t0 = time.perf_counter()
            call = stubs[i % channels].Synthesize(request)
            try:
                async for _ in call:
                    break  # admitted: audio came (with --room > 0)
                status = "OK"
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            seconds = time.perf_counter() - t0
            call.cancel()
            return status, seconds

        await asyncio.sleep(max(0.0, start_at - time.time()))
        got = await asyncio.gather(*(one(i) for i in range(calls)))
        for c in chans:
            await c.close()
        return got

    out.put(asyncio.run(main()))


def burst(target: str, gateway_pid: int, args: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    share = [args.calls // args.processes + (i < args.calls % args.processes) for i in range(args.processes)]
    start_at = time.time() + args.start_in_s
    procs = [
        ctx.Process(target=_client, args=(target, n, args.channels, start_at, not args.no_clip, out))
        for n in share
    ]
    for p in procs:
        p.start()
    cpu0 = None
    while time.time() < start_at:
        cpu0 = cpu_seconds(gateway_pid)
        time.sleep(0.01)
    wall0 = time.perf_counter()
    results = [item for _ in procs for item in out.get(timeout=120)]
    wall = time.perf_counter() - wall0
    cpu = cpu_seconds(gateway_pid) - (cpu0 or 0.0)
    for p in procs:
        p.join(timeout=10)
    by_status: dict[str, list[float]] = {}
    for status, seconds in results:
        by_status.setdefault(status, []).append(seconds)
    return {
        "calls": len(results),
        "statuses": {s: len(v) for s, v in by_status.items()},
        "latency_s": {s: percentiles(v, (50, 95, 99)) for s, v in by_status.items()},
        "burst_wall_s": round(wall, 3),
        "gateway_cpu_s": round(cpu, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calls", type=int, default=768, help="calls in the burst, all processes together")
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--channels", type=int, default=4, help="channels per client process")
    p.add_argument("--room", type=int, default=0, help="streams the stand-in talker has room for")
    p.add_argument("--repeats", type=int, default=3, help="bursts, each after the last has ended")
    p.add_argument("--start-in-s", type=float, default=3.0, help="time the client processes get to connect")
    p.add_argument("--no-clip", action="store_true", help="no reference clip in the requests")
    p.add_argument("--gateway-args", default="--max-streams 1024")
    # room_stack's stand-in talker settings
    p.add_argument("--frames", type=int, default=125)
    p.add_argument("--speedup", type=float, default=4.0)
    p.add_argument("--lead-s", type=float, default=4.0, help="the stand-in talker's pacing lead")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with room_stack(args.out, args) as (_url, pid, _log, grpc_target):
        for i in range(args.repeats):
            row = burst(grpc_target, pid, args)
            rows.append(row)
            ok = row["latency_s"].get("RESOURCE_EXHAUSTED", {})
            print(
                f"burst {i + 1}: {row['statuses']}, refused p50 / p95 / p99 "
                f"{1e3 * (ok.get('p50') or 0):.0f} / {1e3 * (ok.get('p95') or 0):.0f} / "
                f"{1e3 * (ok.get('p99') or 0):.0f} ms, burst {row['burst_wall_s']:.2f} s, "
                f"gateway CPU {row['gateway_cpu_s']:.2f} s",
                flush=True,
            )
            time.sleep(1.0)
    conditions = {k: str(v) for k, v in vars(args).items()}
    (args.out / "burst.json").write_text(json.dumps({"args": conditions, "bursts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
