"""How many streams code2wav's host side carries: the real service with a stand-in decoder.

At c=768 on the H200, code2wav's hop (frames sent to audio back) averaged 1.3 s for steady-state
chunks while its decode calls kept the GPU busy about a sixth of the run. This measures the part
that is not the GPU: the real `Code2WavServer` (gRPC, streams, credits, the decode loop and its
worker thread, PCM conversion) with a decoder that sleeps, without the GIL, for the GPU time a
decode call is given (`--frame-us` per frame plus `--call-us` per call; 27 us a frame is the
H200's slot decoder at bf16) and returns silence of the right length.

A driver in this process plays the talker: `--streams` concurrent Decode calls (a closed loop:
an ended stream is replaced at once), each opening with the request's chunk plan, sending its
frames chunk by chunk as the credit allows, generated `--speedup` times faster than real time
until `--lead-s` ahead of its listener, then in real time; every audio chunk is acked at once.
Per level it reports the hop of every chunk (last frame sent to its audio received), code2wav's
CPU seconds per second and event-loop lag (from its /metrics), its decode calls and batch, and the
driver's own CPU and loop lag (a busy driver delays what it measures too).

    python -m benchmarks.code2wav_host --streams 128 256 512 --seconds 20 --out run/c2w_host.json \
        --code2wav-args "--max-batch 256 --max-states 1024"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from benchmarks.metrics import percentiles
from benchmarks.stack_summary import ScrapedMetrics, bucket_quantile
from qtts.pb import code2wav_pb2_grpc
from qtts.streams.chunk_plan import BUSY_STARTING, DEFAULT_START_POLICY, ChunkPlan
from qtts.streams.decode_events import Credit, DecodedAudio, Done
from services.talker.code2wav_client import DecodeCall

FRAME_S = 0.08
SAMPLES_PER_FRAME = 1920
NUM_CODEBOOKS = 16


class SleepDecoder:
    """A decoder whose calls take the GPU time they are given (sleeping, the GIL released) and
    return silence: code2wav's host side with nothing else slow behind it."""

    accepts_host_codes = True

    def __init__(self, frame_s: float, call_s: float):
        self.frame_s = frame_s
        self.call_s = call_s

    def start(self, prefix_codes=None):
        return object()

    def free(self, state) -> None:
        pass

    def decode(self, state, codes):
        return self.decode_batch([state], [codes])[0]

    def decode_batch(self, states, codes):
        import torch

        time.sleep(self.call_s + self.frame_s * sum(len(c) for c in codes))
        return [torch.zeros(len(c) * SAMPLES_PER_FRAME) for c in codes]


def serve(args: argparse.Namespace) -> None:
    """code2wav on `args.port` (metrics on `args.metrics_port`) with the stand-in decoder."""
    from services.code2wav.config import config_from_args
    from services.code2wav.server import Code2WavServer

    config = config_from_args(
        ["--port", str(args.port), "--metrics-port", str(args.metrics_port), "--drain-seconds", "1"]
        + args.code2wav_args
    )
    decoder = SleepDecoder(args.frame_us / 1e6, args.call_us / 1e6)
    # The stand-in's silence and its PCM conversion run on the CPU where the GPU's would run on the
    # GPU: one torch thread, so that idle OpenMP workers spinning after each small op (about 5x this
    # process's CPU time at 32 streams) are not counted as the service's host cost.
    import torch

    torch.set_num_threads(1)

    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)  # as run_service_main does

    async def main() -> None:
        server = Code2WavServer(config, decoder=decoder)
        await server.run()

    asyncio.run(main())


class Level:
    """What the driver saw at one level."""

    def __init__(self) -> None:
        self.hops: list[float] = []
        self.first_hops: list[float] = []
        self.done = 0
        self.failed: dict[str, int] = {}
        self.lags: list[float] = []


async def one_stream(
    stub, name: str, frames: int, plan: ChunkPlan, args: argparse.Namespace, level: Level
) -> None:
    """One Decode call as the talker makes it: the plan, frames chunk by chunk within the credit,
    every audio chunk acked."""
    call = DecodeCall(stub, "replica")
    await call.start(name, NUM_CODEBOOKS, None, plan.first, plan.ramp)
    codes = np.zeros((frames, NUM_CODEBOOKS), dtype=np.int16)
    allowed = 0
    credit = asyncio.Event()
    writing = asyncio.Lock()  # one write at a time on a call (the talker's stream task is one task)
    sent_at: dict[int, float] = {}  # a chunk's end frame -> when its last frame was sent

    async def read() -> None:
        nonlocal allowed
        async for event in call.events():
            if isinstance(event, Credit):
                allowed = max(allowed, event.frames_allowed_until)
                credit.set()
            elif isinstance(event, DecodedAudio):
                end = event.first_frame_index + event.num_frames
                if (at := sent_at.pop(end, None)) is not None:
                    hops = level.first_hops if event.first_frame_index == 0 else level.hops
                    hops.append(time.perf_counter() - at)
                async with writing:
                    await call.ack(end * SAMPLES_PER_FRAME)
            elif isinstance(event, Done):
                level.done += 1
                return
            else:
                error = getattr(event, "error", None)
                reason = f"{type(event).__name__}: {getattr(error, 'message', '')}"[:90]
                level.failed[reason] = level.failed.get(reason, 0) + 1
                return

    reader = asyncio.create_task(read())
    started = time.perf_counter()
    sent = 0
    try:
        for size in plan.split(frames):
            end = sent + size
            # Made `speedup` x faster than real time until `lead_s` ahead of the listener.
            made_at = started + max(end * FRAME_S / args.speedup, end * FRAME_S - args.lead_s)
            if (wait := made_at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            while allowed < end and not reader.done():
                credit.clear()
                await credit.wait()
            if reader.done():
                break
            sent_at[end] = time.perf_counter()
            async with writing:
                await call.send_frames(sent, codes[sent:end])
            sent = end
        else:
            async with writing:
                await call.end(frames)
        await reader
    finally:
        call.cancel()
        reader.cancel()


async def loop_lag(level: Level, stop: asyncio.Event, interval_s: float = 0.05) -> None:
    """The driver's own event-loop lag, sampled as the services sample theirs."""
    while not stop.is_set():
        due = time.perf_counter() + interval_s
        await asyncio.sleep(interval_s)
        level.lags.append(max(0.0, time.perf_counter() - due))


def scrape(port: int) -> ScrapedMetrics:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return ScrapedMetrics(r.read().decode())


def pcts(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p95 / p99, the mean (benchmarks.metrics.percentiles) and the max; None when empty."""
    return percentiles(values, (50, 95, 99)) | {"max": max(values) if len(values) else None}


class Since:
    """A service's counters and histograms over one level: two scrapes, before and after."""

    def __init__(self, before: ScrapedMetrics, after: ScrapedMetrics):
        self.before, self.after = before, after

    def total(self, name: str, **labels: str) -> float:
        return self.after.total(name, **labels) - self.before.total(name, **labels)

    def mean(self, name: str, **labels: str) -> float | None:
        """A histogram's mean over the level (None: nothing observed)."""
        count = self.total(f"{name}_count", **labels)
        return self.total(f"{name}_sum", **labels) / count if count else None

    def quantiles(self, name: str, *qs: float, **labels: str) -> dict[str, float | None]:
        """A histogram's quantiles over the level, as the bounds of the buckets holding them."""
        old = dict(self.before.buckets(name, **labels))
        diff = [(le, n - old.get(le, 0.0)) for le, n in self.after.buckets(name, **labels)]
        return {f"p{round(100 * q)}_le": bucket_quantile(diff, q) for q in qs}


# code2wav's histograms whose mean over a level says where a chunk's time went.
WHERE = {
    "chunk_wait": ("tts_code2wav_chunk_wait_seconds", {}),
    "first_chunk_wait": ("tts_code2wav_first_chunk_wait_seconds", {}),
    "decode_call": ("tts_code2wav_decode_seconds", {}),
    "open_stream": ("tts_stage_latency_seconds", {"stage": "open_stream"}),
}


async def run_level(streams: int, args: argparse.Namespace) -> dict:
    """`streams` concurrent Decode calls for `args.seconds` (each ended one replaced at once)."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{args.port}")
    stub = code2wav_pb2_grpc.Code2WavServiceStub(channel)
    plan = DEFAULT_START_POLICY.plan(BUSY_STARTING, streams) or ChunkPlan()
    frames = round(args.clip_s / FRAME_S)
    level = Level()
    before = scrape(args.metrics_port)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    deadline = wall0 + args.seconds
    stop = asyncio.Event()
    sampler = asyncio.create_task(loop_lag(level, stop))
    counter = iter(range(10**9))

    async def slot(i: int) -> None:
        await asyncio.sleep(i * args.ramp_s / streams)  # opened over ramp_s, not all at once
        while time.perf_counter() < deadline:
            await one_stream(stub, f"l{streams}-{next(counter)}", frames, plan, args, level)

    await asyncio.gather(*(slot(i) for i in range(streams)))
    stop.set()
    await sampler
    wall = time.perf_counter() - wall0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    c2w = Since(before, scrape(args.metrics_port))
    await channel.close()
    calls = c2w.total("tts_code2wav_decode_batch_streams_count")
    return {
        "streams": streams,
        "plan": [plan.first, list(plan.ramp)],
        "wall_s": wall,
        "streams_done": level.done,
        "failed": level.failed,
        "chunks": len(level.hops),
        "hop_s": pcts(level.hops),
        "first_chunk_hop_s": pcts(level.first_hops),
        "code2wav_cpu_per_s": c2w.total("process_cpu_seconds_total") / wall,
        "code2wav_loop_lag_s": c2w.quantiles("tts_event_loop_lag_seconds", 0.5, 0.99),
        "code2wav_means_s": {key: c2w.mean(name, **labels) for key, (name, labels) in WHERE.items()},
        "decode_calls_per_s": calls / wall,
        "decode_batch_mean": c2w.total("tts_code2wav_decode_batch_streams_sum") / calls if calls else None,
        "code2wav_underruns": c2w.total("tts_code2wav_underruns_total"),
        "driver_cpu_per_s": (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall,
        "driver_loop_lag_s": pcts(level.lags),
    }


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 120.0, name: str = "code2wav") -> None:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{name} did not serve metrics on :{port} within {timeout_s:.0f} s")


def run(args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "benchmarks.code2wav_host", "serve",
        "--port", str(args.port), "--metrics-port", str(args.metrics_port),
        "--frame-us", str(args.frame_us), "--call-us", str(args.call_us),
        "--code2wav-args", shlex.join(args.code2wav_args),
    ]  # fmt: skip
    if args.running:  # a code2wav already serving there (a real decoder on a GPU, say)
        return _result(args, [asyncio.run(run_level(n, args)) for n in args.streams])
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(args.metrics_port, proc)
        time.sleep(1.0)  # health SERVING follows the metrics port by a warm-up decode
        levels = [asyncio.run(run_level(n, args)) for n in args.streams]
    finally:
        stop([proc])
    return _result(args, levels)


def stop(procs: Sequence[subprocess.Popen], grace_s: float = 30.0) -> None:
    """SIGTERM the processes (the last started first), SIGKILL any still there after `grace_s`."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _result(args: argparse.Namespace, levels: list[dict]) -> dict:
    decoder = f"sleep {args.frame_us:g} us a frame + {args.call_us:g} us a call, silence"
    return {
        "benchmark": "code2wav_host",
        "conditions": {
            "decoder": "the running code2wav's own" if args.running else decoder,
            "clip_s": args.clip_s,
            "speedup": args.speedup,
            "lead_s": args.lead_s,
            "seconds": args.seconds,
            "code2wav_args": args.code2wav_args,
            "cpus": os.cpu_count(),
            "command": " ".join(sys.argv),
        },
        "levels": levels,
    }


def host_parser(doc: str, streams: list[int]) -> argparse.ArgumentParser:
    """The flags the host harnesses share: run or serve, the levels, their length and clips."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "serve"))
    parser.add_argument("--streams", type=int, nargs="+", default=streams)
    parser.add_argument("--seconds", type=float, default=20.0, help="each level's length")
    parser.add_argument("--clip-s", type=float, default=10.0, help="audio per stream")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = host_parser(__doc__, [128, 256, 512])
    parser.add_argument("--speedup", type=float, default=8.0, help="frames made this x real time")
    parser.add_argument("--lead-s", type=float, default=4.0, help="until this far ahead of playback")
    parser.add_argument("--ramp-s", type=float, default=2.0, help="a level's streams open over this")
    parser.add_argument("--frame-us", type=float, default=27.0, help="decode GPU time a frame")
    parser.add_argument("--call-us", type=float, default=500.0, help="decode GPU time a call")
    parser.add_argument("--port", type=int, default=50353)
    parser.add_argument("--metrics-port", type=int, default=9353)
    parser.add_argument(
        "--running", action="store_true", help="drive the code2wav serving on --port (no stand-in)"
    )
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    parser.add_argument(
        "--code2wav-args", type=shlex.split, default=[], help='code2wav flags, e.g. "--max-batch 256"'
    )
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(args)
        return 0
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for lv in result["levels"]:
        hop = lv["hop_s"]
        print(
            f"streams {lv['streams']:5d}: chunks {lv['chunks']:6d}, hop p50/p95/p99 "
            f"{1e3 * (hop['p50'] or 0):.1f}/{1e3 * (hop['p95'] or 0):.1f}/{1e3 * (hop['p99'] or 0):.1f} ms, "
            f"code2wav CPU {lv['code2wav_cpu_per_s']:.2f} s/s, lag p99 <= {lv['code2wav_loop_lag_s']['p99_le']}, "
            f"calls {lv['decode_calls_per_s']:.0f}/s x {lv['decode_batch_mean'] or 0:.1f}, "
            f"driver CPU {lv['driver_cpu_per_s']:.2f} s/s, failed {sum(lv['failed'].values())}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
