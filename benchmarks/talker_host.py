"""How many streams the talker's host side carries: the real talker and code2wav, GPUs stood in.

The talker's front (the Generate calls, the deadline scheduler, the engine thread, the relay of
every chunk from code2wav to the caller, credits and acks) is the real `TalkerServer` with a
stand-in model: a step that sleeps, the GIL released, for the H200's frame step (`--step-ms` plus
`--step-us-per-stream` a stream: 4.4 ms + 20 us) and returns silent codes, and prompts that end
after the requested frames. code2wav is `code2wav_host`'s stand-in. `--engine-process` puts the
engine in a process of its own, as on a GPU.

A driver in this process plays the gateway (`--sessions`: opens on a Session call, as it sends
them): `--streams` concurrent Generate calls in a closed loop (`--clip-s` of audio each, a preset
voice), each listened to in real time from its first chunk: a chunk that arrives after its audio
was due is a gap. Per level: first audio, gaps, refusals, the talker's loop lag, CPU, underruns and
chunk hops, the driver's CPU and loop lag.

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

from benchmarks.code2wav_host import Since, host_parser, loop_lag, pcts, scrape, stop, wait_ready
from qtts.model.sampling import SamplingParams
from qtts.pb import talker_pb2, talker_pb2_grpc
from qtts.request.errors import ResourceExhausted, from_grpc
from qtts.serving import probe
from qtts.serving.log_context import outgoing_metadata
from services.gateway.talker_pool import StaticResolver, TalkerPool, capacity_probe, capacity_watch
from services.gateway.talker_session import TalkerSession

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
    # What the scheduler reads of a prompt's positions (`embeds.shape[0]`): a voice clone's 299 by
    # default ("positions=N" in the text sets it), so the talker times the stand-in's prefills
    # (`--prefill-ms`) and learns their cost as on a GPU instead of keeping its prior.
    embeds: Any = None


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
        positions = int(words.get("positions", 299))
        return Prompt(frames=int(words.get("frames", 125)), embeds=SimpleNamespace(shape=(positions, 0)))

    @property
    def prompt_builder(self) -> SimpleNamespace:
        """The engine process builds its queued prompts together (`build_many`)."""
        return SimpleNamespace(build_many=lambda specs: [self.build_prompt(spec) for spec in specs])


class SleepGenerator:
    """The engine's generator contract, its step a sleep of the H200 frame step's length."""

    def __init__(self, max_batch: int, step_s: float, per_stream_s: float, prefill_s: float = 0.0):
        import torch

        self.max_batch = max_batch
        self.step_s, self.per_stream_s = step_s, per_stream_s
        # Each request added since the last step makes that step longer by this (its prefill).
        self.prefill_s = prefill_s
        self._prefills = 0
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
        self._prefills += 1

    def cancel(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def step(self, skip=()) -> list:
        skip = set(skip)
        stepping = [rid for rid in self._active if rid not in skip]
        time.sleep(self.step_s + self.per_stream_s * len(stepping) + self.prefill_s * self._prefills)
        self._prefills = 0
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


# Set by `serve --engine-process`: "step_ms,step_us_per_stream,prefill_ms". The engine process is spawned and
# imports this module afresh (as multiprocessing's main module), so the stand-in model it loads
# is installed at import, from the environment it inherits.
STAND_IN_ENV = "TALKER_HOST_STAND_IN"


def install_stand_in(step_ms: float, step_us_per_stream: float, prefill_ms: float = 0.0) -> None:
    """Make the talker's model setup load the stand-in model and generator."""
    from services.talker import model_setup

    model_setup.load_bundle = lambda config: StandInBundle()
    model_setup.generator_factory_for = lambda config: (
        lambda bundle, n: SleepGenerator(n, step_ms / 1e3, step_us_per_stream / 1e6, prefill_ms / 1e3)
    )


if os.environ.get(STAND_IN_ENV):
    install_stand_in(*(float(x) for x in os.environ[STAND_IN_ENV].split(",")))


def serve(args: argparse.Namespace) -> None:
    """The talker on `args.port` with the stand-in model, its code2wav at `args.code2wav`."""
    from services.talker.config import config_from_args
    from services.talker.server import TalkerServer

    config = config_from_args(
        ["--port", str(args.port), "--metrics-port", str(args.metrics_port), "--code2wav", args.code2wav]
        + ["--drain-seconds", "1", "--max-batch", "1024", "--max-queue", "2048"]
        + (["--engine-process", "on"] if args.engine_process else [])
        + args.talker_args
    )
    sys.setswitchinterval(config.gil_switch_interval_ms / 1e3)

    async def main() -> None:
        if args.engine_process:  # as on the GPU: the engine in a process of its own
            os.environ[STAND_IN_ENV] = f"{args.step_ms},{args.step_us_per_stream},{args.prefill_ms}"
            install_stand_in(args.step_ms, args.step_us_per_stream, args.prefill_ms)
            server = TalkerServer(config, spec_factory=Spec, run_warm_up=False)
        else:
            server = TalkerServer(
                config,
                bundle=StandInBundle(),
                generator_factory=lambda bundle, n: SleepGenerator(
                    n, args.step_ms / 1e3, args.step_us_per_stream / 1e6, args.prefill_ms / 1e3
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
        self.polls: list[float] = []  # --gateway-pool: each capacity poll's round trip


def refused(level: Level, sent: float, message: str) -> None:
    reason = re.sub(r"\b\d+(\.\d+)?\b", "N", message)[:100]
    level.refusal_reasons.setdefault(reason, []).append(time.perf_counter() - sent)


async def pooled_stream(pool: TalkerPool, name: str, args: argparse.Namespace, level: Level) -> None:
    """One stream as the gateway starts it: refused at once while the talker's published room is
    spent (`TalkerPool.acquire`), otherwise a call on the picked talker's channel, whose refusal
    marks it full until its next published room."""
    sent = time.perf_counter()
    try:
        lease = await pool.acquire()
    except ResourceExhausted as exc:
        refused(level, sent, f"gateway: {exc.message}")
        await asyncio.sleep(retry_s(args))
        return
    with lease:
        stub = talker_pb2_grpc.TalkerServiceStub(lease.channel)
        session = session_of(lease.channel) if args.sessions else None
        error = await one_stream(stub, name, args, level, sent, lease.metadata, session)
        if isinstance(error, ResourceExhausted):
            lease.mark_full(error.retry_after_s)
    if error is not None:
        await asyncio.sleep(retry_s(args))


_SESSIONS: dict[Any, TalkerSession] = {}  # --sessions: one per channel, as the gateway keeps


def session_of(channel: Any) -> TalkerSession:
    if channel not in _SESSIONS:
        _SESSIONS[channel] = TalkerSession(channel)
    return _SESSIONS[channel]


def retry_s(args: argparse.Namespace) -> float:
    """Refused clients that all wait the same retry_s come back together, as clients that honour
    one Retry-After do; --retry-jitter spreads them over +-that share of it."""
    return args.retry_s * (1 + args.retry_jitter * (2 * random.random() - 1))


async def one_stream(  # noqa: PLR0913
    stub, name: str, args: argparse.Namespace, level: Level, sent=None, metadata=(), session=None
) -> ResourceExhausted | None:
    """One Generate call, listened to in real time from its first chunk. Returns its refusal
    (recorded) when refused before any audio; the caller waits before retrying."""
    sent = time.perf_counter() if sent is None else sent
    frames = round(args.clip_s / FRAME_S)  # a known length, as the benchmark client's max_new_tokens
    request = talker_pb2.GenerateRequest(
        request_id=name, text=f"frames={frames}", voice=VOICE, language="english", max_new_frames=frames
    )
    first_at, worst = None, 0.0
    try:
        md = outgoing_metadata(name) + metadata
        # A session's open is None until its call has answered: a Generate call meanwhile.
        call = (session and session.open(request, md)) or stub.Generate(request, metadata=md)
        async for msg in call:
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
            refused(level, sent, exc.details() or "")
            return from_grpc(exc.code(), exc.details(), exc.trailing_metadata())
        key = f"{exc.code().name}: {exc.details()}"[:90]
        level.errors[key] = level.errors.get(key, 0) + 1
    return None


async def run_level(streams: int, args: argparse.Namespace) -> dict:
    address = f"127.0.0.1:{args.port}"
    # --channels N: N connections (a local subchannel pool each), streams spread over them.
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(args.channels)
    ]
    stubs = [talker_pb2_grpc.TalkerServiceStub(c) for c in channels]
    sessions = [session_of(c) if args.sessions else None for c in channels]
    level = Level()
    pools: list[TalkerPool] = []
    if args.gateway_pool:

        async def timed_probe(ch: Any, caller: str) -> Any:
            start = time.perf_counter()
            try:
                return await capacity_probe(ch, caller)
            finally:
                level.polls.append(time.perf_counter() - start)

        watch = None if args.gateway_pool == "poll" else capacity_watch
        for _ in range(args.gateways):  # a pool each: gateways of their own (caller ids)
            pool = TalkerPool(StaticResolver([address]), capacity=timed_probe, watch=watch)
            await pool.refresh()
            pool.start()
            pools.append(pool)
    talker0, c2w0 = scrape(args.metrics_port), scrape(args.code2wav_metrics_port)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    deadline = wall0 + args.seconds
    stop = asyncio.Event()
    sampler = asyncio.create_task(loop_lag(level, stop))
    counter = iter(range(10**9))

    async def slot(i: int) -> None:
        await asyncio.sleep(i * args.ramp_s / streams)
        while time.perf_counter() < deadline:
            name = f"t{streams}-{next(counter)}"
            if pools:
                await pooled_stream(pools[i % len(pools)], name, args, level)
            elif await one_stream(stubs[i % len(stubs)], name, args, level, session=sessions[i % len(stubs)]):
                await asyncio.sleep(retry_s(args))

    await asyncio.gather(*(slot(i) for i in range(streams)))
    stop.set()
    await sampler
    wall = time.perf_counter() - wall0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    talker = Since(talker0, scrape(args.metrics_port))
    c2w = Since(c2w0, scrape(args.code2wav_metrics_port))
    for session in _SESSIONS.values():
        await session.close()
    _SESSIONS.clear()
    for channel in channels:
        await channel.close()
    for pool in pools:
        await pool.close()
    generate = {"method": "/talker.v1.TalkerService/Generate"}
    polls = {"method": "/talker.v1.TalkerService/GetCapacity"}
    hop_s = "tts_talker_chunk_hop_seconds"
    stage_s = "tts_stage_latency_seconds"
    gaps = np.asarray(level.worst_gap) if level.worst_gap else np.zeros(0)
    refusals = [t for times in level.refusal_reasons.values() for t in times]
    return {
        "streams": streams,
        "wall_s": wall,
        "finished": len(level.worst_gap),
        "gap_free_share": float((gaps <= 0).mean()) if len(gaps) else None,
        "worst_gap_s": pcts([g for g in level.worst_gap if g > 0]),
        "ttfa_s": pcts(level.ttfa),
        "refused": len(refusals),
        "refusal_s": pcts(refusals),
        "refusal_reasons": {k: {"count": len(v)} | pcts(v) for k, v in level.refusal_reasons.items()},
        "capacity_poll_s": pcts(level.polls) | {"count": len(level.polls)},
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
        "talker_capacity_accept_s": {"mean": talker.mean("tts_rpc_accept_seconds", **polls)}
        | talker.quantiles("tts_rpc_accept_seconds", 0.5, 0.95, **polls),
        "code2wav_cpu_per_s": c2w.total("process_cpu_seconds_total") / wall,
        "code2wav_underruns": c2w.total("tts_code2wav_underruns_total"),
        "driver_cpu_per_s": (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / wall,
        "driver_loop_lag_s": pcts(level.lags),
    }


def wait_serving(
    address: str, proc: subprocess.Popen, timeout_s: float = 180.0, name: str = "the talker"
) -> None:
    """Until the service's health says SERVING (for the talker: model loaded, a code2wav replica
    on its ring)."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode} before it served")
        if probe.health_status(address, timeout=2.0) == "SERVING":
            return
        time.sleep(0.5)
    raise SystemExit(f"{name} at {address} was not SERVING within {timeout_s:.0f} s")


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
    talker += ["--prefill-ms", str(args.prefill_ms), "--talker-args", shlex.join(args.talker_args)]
    talker += ["--engine-process"] if args.engine_process else []
    procs = [subprocess.Popen(c2w, env=env)]
    try:
        wait_ready(args.code2wav_metrics_port, procs[0])
        procs.append(subprocess.Popen(talker, env=env))
        wait_ready(args.metrics_port, procs[1], name="talker")
        wait_serving(f"127.0.0.1:{args.port}", procs[1])  # its engine loaded, its ring connected
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
            "engine": "own process" if args.engine_process else "in the talker's process",
            "driver": f"gateway pool ({args.gateway_pool})" if args.gateway_pool else "direct Generate calls",
            "gateways": args.gateways if args.gateway_pool else 0,
            "code2wav_args": args.code2wav_args,
            "cpus": os.cpu_count(),
            "command": " ".join(sys.argv),
        },
        "levels": levels,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = host_parser(__doc__, [256, 512])
    parser.add_argument("--ramp-s", type=float, default=2.0, help="a level's streams start over this")
    parser.add_argument("--retry-s", type=float, default=1.0, help="a refused stream waits this long")
    parser.add_argument("--retry-jitter", type=float, default=0.0, help="+- this share of --retry-s")
    parser.add_argument(
        "--gateway-pool",
        nargs="?",
        const="watch",
        choices=("watch", "poll"),
        default=None,
        help="start streams as the gateway does: refused at once from the talker's published room, "
        "watched (WatchCapacity) or polled (GetCapacity every 100 ms)",
    )
    parser.add_argument(
        "--gateways", type=int, default=1, help="--gateway-pool: gateways the streams alternate over"
    )
    parser.add_argument("--channels", type=int, default=1, help="direct calls: connections to spread over")
    parser.add_argument(
        "--sessions", action="store_true", help="opens on a Session call (default: Generate calls)"
    )
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="the talker's engine in a process of its own, as on the GPU (default: in the talker's)",
    )
    parser.add_argument("--step-ms", type=float, default=4.4, help="frame step at batch 1")
    parser.add_argument("--step-us-per-stream", type=float, default=20.0, help="frame step per stream")
    parser.add_argument(
        "--prefill-ms", type=float, default=0.0, help="a step's extra time per request prefilled in it"
    )
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
