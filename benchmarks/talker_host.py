"""How many streams the talker's host side carries: the real talker and code2wav, GPUs stood in.

`benchmarks/code2wav_host.py` showed code2wav's host side carrying 768 streams on this machine
with no underrun, so the late chunks the H200 showed at c=768 come from elsewhere. This runs the
next suspect: the talker's front (the Generate calls, the deadline scheduler, the engine thread,
the relay of every chunk from code2wav to the caller, credits and acks). The talker is the real
`TalkerServer` with a stand-in model: a generator whose step sleeps, the GIL released, for the
time the H200's frame step takes (`--step-ms` plus `--step-us-per-stream` a stream: 4.4 ms +
20 us, the 1.7B graph step at batch 1 and its slope to 1,024) and returns silent codes, and prompts
that end after the requested number of frames. code2wav is `code2wav_host`'s stand-in. The engine
runs in the talker's process (an injected model cannot cross to an engine process), the setting
`--engine-process` was made to avoid: the host work of its steps shares the GIL with the relay.

A driver in this process plays the gateway: `--streams` concurrent Generate calls in a closed loop
(`--clip-s` of audio each, a preset voice), each listened to in real time from its first chunk:
a chunk that arrives after its audio was due is a gap. Per level: first audio, the streams with a
gap and the worst gap, refusals, the talker's loop lag, CPU and underruns, its chunk hops, and the
driver's own CPU and loop lag.

    python -m benchmarks.talker_host --streams 256 512 768 --seconds 20 --out run/talker_host.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np

from benchmarks.code2wav_host import Since, loop_lag, pcts, scrape, stop, wait_ready
from qtts.model.sampling import SamplingParams
from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.serving.log_context import outgoing_metadata

FRAME_S = 0.08
VOICE = "vivian"


@dataclasses.dataclass
class Spec:
    text: str
    task: str = ""
    speaker: str | None = None
    language: str = "auto"
    instruct: str | None = None
    voice_prompt: Any = None
    streaming_text: bool | None = None


@dataclasses.dataclass
class Prompt:
    frames: int
    end_reason: str = "stop"
    ref_codes: Any = None


class StandInBundle:
    """What the talker uses of a model bundle: a CustomVoice model whose prompt for text
    "frames=N" makes N frames."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(
            name="stand-in",
            model_type="custom_voice",
            model_size="1b7",
            speakers={VOICE: 3065},
            languages={"english": 2050},
            num_codebooks=16,
            codebook_size=2048,
            sample_rate=24000,
            samples_per_frame=1920,
        )
        self.generation_defaults = SamplingParams()

    def compute_voice_prompt(self, pcm, ref_text, x_vector_only):
        raise ValueError("the stand-in model has only its preset voice")

    def build_prompt(self, spec: Spec) -> Prompt:
        words = dict(w.split("=", 1) for w in spec.text.split() if "=" in w)
        return Prompt(frames=int(words.get("frames", 125)))


class SleepGenerator:
    """The engine's generator contract, its step a sleep of the H200 frame step's length."""

    def __init__(self, max_batch: int, step_s: float, per_stream_s: float):
        import torch

        self.max_batch = max_batch
        self.step_s, self.per_stream_s = step_s, per_stream_s
        self._active: dict[str, list] = {}
        self._codes = torch.zeros(16, dtype=torch.long)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def add(self, request_id, prompt, sampling, max_new_frames=None) -> None:
        self._active[request_id] = [
            prompt.frames if max_new_frames is None else min(prompt.frames, max_new_frames),
            0,
        ]

    def cancel(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def step(self, skip=()) -> list:
        skip = set(skip)
        stepping = [rid for rid in self._active if rid not in skip]
        time.sleep(self.step_s + self.per_stream_s * len(stepping))
        outs = []
        for rid in stepping:
            state = self._active[rid]
            if state[1] == state[0]:
                del self._active[rid]
                outs.append(SimpleNamespace(request_id=rid, codes=None, finished=True, finish_reason="stop"))
                continue
            state[1] += 1
            outs.append(
                SimpleNamespace(request_id=rid, codes=self._codes, finished=False, finish_reason=None)
            )
        return outs


def serve(args: argparse.Namespace) -> None:
    """The talker on `args.port` with the stand-in model, its code2wav at `args.code2wav`."""
    from services.talker.config import config_from_args
    from services.talker.server import TalkerServer

    config = config_from_args(
        ["--port", str(args.port), "--metrics-port", str(args.metrics_port), "--code2wav", args.code2wav]
        + ["--drain-seconds", "1", "--max-batch", "1024", "--max-queue", "2048"]
        + args.talker_args
    )
    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)

    async def main() -> None:
        server = TalkerServer(
            config,
            bundle=StandInBundle(),
            generator_factory=lambda bundle, n: SleepGenerator(
                n, args.step_ms / 1e3, args.step_us_per_stream / 1e6
            ),
            spec_factory=Spec,
            run_warm_up=False,
        )
        await server.run()

    asyncio.run(main())


class Level:
    def __init__(self) -> None:
        self.ttfa: list[float] = []
        self.worst_gap: list[float] = []  # per finished stream
        self.refusal_reasons: dict[str, list[float]] = {}  # reason (numbers folded) -> latencies
        self.errors: dict[str, int] = {}
        self.lags: list[float] = []


async def one_stream(stub, name: str, args: argparse.Namespace, level: Level) -> None:
    """One Generate call, listened to in real time from its first chunk."""
    sent = time.perf_counter()
    frames = round(args.clip_s / FRAME_S)  # a known length, as the benchmark client's max_new_tokens
    request = talker_pb2.GenerateRequest(
        request_id=name, text=f"frames={frames}", voice=VOICE, language="english", max_new_frames=frames
    )
    first_at, worst = None, 0.0
    try:
        async for msg in stub.Generate(request, metadata=outgoing_metadata(name)):
            if msg.WhichOneof("event") != "audio":
                continue
            now = time.perf_counter()
            if first_at is None:
                first_at = now
                level.ttfa.append(now - sent)
            else:  # its audio was due when the frames before it had played
                worst = max(worst, now - (first_at + msg.audio.first_frame_index * FRAME_S))
        level.worst_gap.append(worst)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and first_at is None:
            reason = re.sub(r"\b\d+(\.\d+)?\b", "N", exc.details() or "")[:100]
            level.refusal_reasons.setdefault(reason, []).append(time.perf_counter() - sent)
            # Refused clients that all wait the same retry_s come back together, as clients that
            # honour one Retry-After do; --retry-jitter spreads them over +-that share of it.
            await asyncio.sleep(args.retry_s * (1 + args.retry_jitter * (2 * random.random() - 1)))
        else:
            key = f"{exc.code().name}: {exc.details()}"[:90]
            level.errors[key] = level.errors.get(key, 0) + 1


async def run_level(streams: int, args: argparse.Namespace) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{args.port}")
    stub = talker_pb2_grpc.TalkerServiceStub(channel)
    level = Level()
    talker0, c2w0 = scrape(args.metrics_port), scrape(args.code2wav_metrics_port)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    deadline = wall0 + args.seconds
    stop = asyncio.Event()
    sampler = asyncio.create_task(loop_lag(level, stop))
    counter = iter(range(10**9))

    async def slot(i: int) -> None:
        await asyncio.sleep(i * args.ramp_s / streams)
        while time.perf_counter() < deadline:
            await one_stream(stub, f"t{streams}-{next(counter)}", args, level)

    await asyncio.gather(*(slot(i) for i in range(streams)))
    stop.set()
    await sampler
    wall = time.perf_counter() - wall0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    talker = Since(talker0, scrape(args.metrics_port))
    c2w = Since(c2w0, scrape(args.code2wav_metrics_port))
    await channel.close()
    generate = {"method": "/talker.v1.TalkerService/Generate"}
    hop_s = "tts_talker_chunk_hop_seconds"
    stage_s = "tts_stage_latency_seconds"
    gaps = np.asarray(level.worst_gap) if level.worst_gap else np.zeros(0)
    refused = [t for times in level.refusal_reasons.values() for t in times]
    return {
        "streams": streams,
        "wall_s": wall,
        "finished": len(level.worst_gap),
        "gap_free_share": float((gaps <= 0).mean()) if len(gaps) else None,
        "worst_gap_s": pcts([g for g in level.worst_gap if g > 0]),
        "ttfa_s": pcts(level.ttfa),
        "refused": len(refused),
        "refusal_s": pcts(refused),
        "refusal_reasons": {k: {"count": len(v)} | pcts(v) for k, v in level.refusal_reasons.items()},
        "errors": level.errors,
        "talker_cpu_per_s": talker.total("process_cpu_seconds_total") / wall,
        "talker_loop_lag_s": talker.quantiles("tts_event_loop_lag_seconds", 0.5, 0.99),
        "talker_underruns": talker.total("tts_talker_underruns_total"),
        "talker_chunk_hop_means_s": {
            hop: talker.mean(hop_s, hop=hop) for hop in talker.after.label_values(hop_s, "hop")
        },
        "talker_stages": {
            stage: {
                "count": talker.total(f"{stage_s}_count", stage=stage),
                "mean_s": talker.mean(stage_s, stage=stage),
            }
            for stage in talker.after.label_values(stage_s, "stage")
        },
        # From the driver's send to the talker's Generate handler (one host, one clock).
        "talker_accept_s": {"mean": talker.mean("tts_rpc_accept_seconds", **generate)}
        | talker.quantiles("tts_rpc_accept_seconds", 0.5, 0.95, **generate),
        "code2wav_cpu_per_s": c2w.total("process_cpu_seconds_total") / wall,
        "code2wav_underruns": c2w.total("tts_code2wav_underruns_total"),
        "driver_cpu_per_s": (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall,
        "driver_loop_lag_s": pcts(level.lags),
    }


def run(args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    c2w = [sys.executable, "-m", "benchmarks.code2wav_host", "serve", "--port", str(args.code2wav_port)]
    c2w += [
        "--metrics-port",
        str(args.code2wav_metrics_port),
        "--code2wav-args",
        shlex.join(args.code2wav_args),
    ]
    talker = [sys.executable, "-m", "benchmarks.talker_host", "serve", "--port", str(args.port)]
    talker += ["--metrics-port", str(args.metrics_port), "--code2wav", f"127.0.0.1:{args.code2wav_port}"]
    talker += ["--step-ms", str(args.step_ms), "--step-us-per-stream", str(args.step_us_per_stream)]
    talker += ["--talker-args", shlex.join(args.talker_args)]
    procs = [subprocess.Popen(c2w, env=env)]
    try:
        wait_ready(args.code2wav_metrics_port, procs[0])
        procs.append(subprocess.Popen(talker, env=env))
        wait_ready(args.metrics_port, procs[1], name="talker")
        time.sleep(2.0)  # both SERVING, the talker's ring connected
        levels = [asyncio.run(run_level(n, args)) for n in args.streams]
    finally:
        stop(procs)
    return {
        "benchmark": "talker_host",
        "conditions": {
            "talker": f"stand-in model, step {args.step_ms:g} ms + {args.step_us_per_stream:g} us a stream (sleep)",
            "code2wav": "code2wav_host's stand-in decoder (27 us a frame + 500 us a call)",
            "clip_s": args.clip_s,
            "seconds": args.seconds,
            "talker_args": args.talker_args,
            "code2wav_args": args.code2wav_args,
            "cpus": os.cpu_count(),
            "command": " ".join(sys.argv),
        },
        "levels": levels,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="run", choices=("run", "serve"))
    parser.add_argument("--streams", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--seconds", type=float, default=20.0, help="each level's length")
    parser.add_argument("--clip-s", type=float, default=10.0, help="audio per stream")
    parser.add_argument("--ramp-s", type=float, default=2.0, help="a level's streams start over this")
    parser.add_argument("--retry-s", type=float, default=1.0, help="a refused stream waits this long")
    parser.add_argument("--retry-jitter", type=float, default=0.0, help="+- this share of --retry-s")
    parser.add_argument("--step-ms", type=float, default=4.4, help="frame step at batch 1")
    parser.add_argument("--step-us-per-stream", type=float, default=20.0, help="frame step per stream")
    parser.add_argument("--port", type=int, default=50452)
    parser.add_argument("--metrics-port", type=int, default=9452)
    parser.add_argument("--code2wav", default="", help="serve: code2wav's address")
    parser.add_argument("--code2wav-port", type=int, default=50453)
    parser.add_argument("--code2wav-metrics-port", type=int, default=9453)
    parser.add_argument("--talker-args", type=shlex.split, default=[], help="more talker flags")
    parser.add_argument(
        "--code2wav-args", type=shlex.split, default=["--max-batch", "256", "--max-states", "2048"]
    )
    parser.add_argument("--out", type=Path, default=None, help="results JSON")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        serve(args)
        return 0
    result = run(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    for lv in result["levels"]:
        ttfa, gap = lv["ttfa_s"], lv["worst_gap_s"]
        share = lv["gap_free_share"]
        print(
            f"streams {lv['streams']:5d}: finished {lv['finished']:5d}, gap-free "
            f"{'-' if share is None else f'{100 * share:.1f}%'}, worst gap p95 {1e3 * (gap['p95'] or 0):.0f} ms, "
            f"TTFA p50/p95 {1e3 * (ttfa['p50'] or 0):.0f}/{1e3 * (ttfa['p95'] or 0):.0f} ms, refused {lv['refused']}, "
            f"talker CPU {lv['talker_cpu_per_s']:.2f} s/s lag p99 <= {lv['talker_loop_lag_s']['p99_le']}, "
            f"code2wav CPU {lv['code2wav_cpu_per_s']:.2f}, driver CPU {lv['driver_cpu_per_s']:.2f}, "
            f"errors {sum(lv['errors'].values())}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
