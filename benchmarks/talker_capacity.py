"""Talker capacity: the most concurrent streams the GraphEngine keeps real-time with prefill mixed in.

Loads the full-size talker (`configs/<model>`, seeded random bf16 weights: the same compute as real
ones) into one `GraphEngine` with a slot per stream of the largest level, then for each level N
(`--streams`, e.g. 64 ... 1280):

- keeps N voice-clone (ICL) requests in the engine: each has a `--prompt-len`-position prompt
  (reference frames + transcript + target text) and a fixed length of `--frames` frames
  (`min_new_tokens` = `max_new_frames`); the first N get staggered lengths so that departures are
  spread out, and every request that finishes is replaced at once by a new one, so a new prompt
  arrives every L/N steps on average and prefill traffic never stops (distinct voices: the
  prefix cache is off unless `--prefix-cache-mb`);
- once every initial stream produced its first frame and the prompts queued meanwhile fit in one
  step's prefill budget, or `--frames` steps after that (steady state), measures `--measure-steps`
  steps: the wall
  time of each `step()` (it ends with the codes' device-to-host copy, so it is synchronous) and,
  for every running stream, the interval between consecutive frames (the first frame of a
  stream is excluded: that is its start-up, not its cadence);
- real-time when the p99 frame interval is within `--budget-ms` (80 ms = one frame of audio)
  and the level is carried: on average at least `--min-running-share` of its N streams produce a
  frame each step (a prefill backlog leaves requests waiting, which would otherwise look like
  headroom);
  the report also gives the p99 interval / median step ratio (the design target: <= 1.5 with new
  streams arriving every few frames) and the prefill positions per step.

The result is the largest N that is real-time. JSON to `--out`, a table on stdout.

    python -m benchmarks.talker_capacity --out run/talker_capacity.json
    python -m benchmarks.talker_capacity --streams 256,512,768 --frames 125 --budget-ms 60
    python -m benchmarks.talker_capacity --device cpu --tiny        # smoke run, seconds, tiny model
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.revision import git_revision
from benchmarks.talker_capacity_table import print_level, print_table
from qtts.engine import GraphEngine, GraphEngineConfig, RunnerConfig
from qtts.engine.model_runner import DEFAULT_BATCH_BUCKETS
from qtts.engine.sequence import SeqStatus
from qtts.model import SamplingParams, SynthesisSpec, TalkerPrompt, VoicePrompt, load_talker_bundle

REPO_ROOT = Path(__file__).resolve().parent.parent
FRAME_MS = 80.0
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank today.",
    "Streaming speech should start quickly and never stall while the listener waits.",
    "Please confirm your appointment for Tuesday morning at half past nine.",
    "A gentle breeze carried the smell of rain across the empty market square.",
]
REF_TEXT = "This is the reference recording of my voice."


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def build_prompts(bundle, count: int, prompt_len: int, seed: int = 0) -> list[TalkerPrompt]:
    """`count` voice-clone ICL prompts of about `prompt_len` positions, each with its own voice."""
    g = torch.Generator().manual_seed(seed)
    h = bundle.config.talker.decoder.hidden_size
    size = bundle.config.talker.codebook_size
    prompts = []
    for i in range(count):
        # Streaming ICL: the body has one position per reference frame plus codec_bos, and the
        # head 9 (role 3 + think/lang/think_eos 4 + speaker + pad), so frames = length - 10.
        frames = max(1, prompt_len - 10)
        voice = VoicePrompt(
            x_vector=torch.randn(h, generator=g) * 0.02,
            ref_codes=torch.randint(0, size, (frames, 16), generator=g),
            ref_text=REF_TEXT,
            x_vector_only=False,
        )
        spec = SynthesisSpec(
            text=TEXTS[i % len(TEXTS)], task="voice_clone", language="english", voice_prompt=voice
        )
        prompts.append(bundle.build_prompt(spec))
    return prompts


@dataclass
class CapacityLevel:
    """Book-keeping of one level: which requests are in, their last frame time, what was measured."""

    target: int
    next_id: int = 0
    # Requests waiting for a free slot, as the deadline scheduler holds them (the engine has no
    # queue: `add` takes a slot at once). Each level holds at most a slot per request, so none
    # waits unless a slot is still taken when its replacement arrives.
    waiting: deque = field(default_factory=deque)
    last_frame_s: dict[str, float] = field(default_factory=dict)
    initial: set[str] = field(default_factory=set)
    started_initial: set[str] = field(default_factory=set)
    step_ms: list[float] = field(default_factory=list)
    intervals_ms: list[float] = field(default_factory=list)
    running_per_step: list[int] = field(default_factory=list)
    prefill_per_step: list[int] = field(default_factory=list)
    waiting_per_step: list[int] = field(default_factory=list)
    prefilling_per_step: list[int] = field(default_factory=list)  # admitted, prompt not yet all in KV
    prefill_chunks: int = 0
    prefill_completed: int = 0  # chunks that finished a prompt
    prefill_requests: int = 0  # distinct requests prefilled, summed over steps
    arrivals: int = 0
    frames: int = 0
    finished: int = 0


def run_level(
    eng: GraphEngine, counter: PrefillCounter, prompts: list[TalkerPrompt], n: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Hold `n` requests in the engine (replacing each finished one), measure `args.measure_steps`
    steps once every initial request produced a frame."""
    run = CapacityLevel(target=n)
    frames = args.frames

    def add(length: int) -> str:
        rid = f"n{n}-r{run.next_id}"
        prompt = prompts[run.next_id % len(prompts)]
        run.next_id += 1
        sampling = SamplingParams(greedy=args.greedy, seed=run.next_id, min_new_tokens=length)
        run.waiting.append((rid, prompt, sampling, length))
        _admit(eng, run)
        return rid

    for i in range(n):  # staggered lengths: departures (and so arrivals) spread over the frames
        run.initial.add(add(1 + (i * frames) // n if args.stagger else frames))
    measuring = False
    warm_steps = since_started = 0
    limit = args.max_warmup_steps
    while True:
        _admit(eng, run)
        counter.reset()
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        if measuring:
            _record_step(run, eng, counter, len(outs), (t1 - t0) * 1e3)
        _take_outputs(run, outs, t1, measuring, add, frames)
        if not measuring:
            warm_steps += 1
            # Steady state: every initial request produced a frame and the prompts queued meanwhile
            # (replacements of the short initial requests, prefilled after all initial ones) fit in
            # one step's prefill budget, or one request lifetime has passed since (a backlog left
            # then is the level's own: prefill does not keep up). Measuring earlier counted that
            # start-up backlog as this level's prefill traffic and its requests as missing streams.
            if len(run.started_initial) == n:
                since_started += 1
                settled = prefill_backlog(eng, run) <= eng.scheduler.max_prefill_tokens
                if settled or since_started >= frames:
                    measuring = True
            if warm_steps >= limit:
                measuring = True
        elif len(run.step_ms) >= args.measure_steps:
            break
    run.waiting.clear()
    for rid in list(eng.scheduler.running):
        eng.cancel(rid)
    return summarize(run, warm_steps, args)


def _record_step(
    run: CapacityLevel, eng: GraphEngine, counter: PrefillCounter, running: int, step_ms: float
) -> None:
    """One measured step's time, batch, prefill traffic and queue lengths into `run`."""
    run.step_ms.append(step_ms)
    run.running_per_step.append(running)
    run.prefill_per_step.append(counter.positions)
    run.waiting_per_step.append(len(run.waiting))
    run.prefilling_per_step.append(
        sum(s.status is SeqStatus.PREFILLING for s in eng.scheduler.running.values())
    )
    run.prefill_chunks += counter.chunks
    run.prefill_completed += counter.completed
    run.prefill_requests += len(counter.requests)


def _take_outputs(
    run: CapacityLevel, outs: list[Any], t1: float, measuring: bool, add: Callable[[int], str], frames: int
) -> None:
    """A step's outputs (made at `t1`): frame intervals and counts, the initial requests started,
    and a replacement of `frames` frames (`add`) for every finished request."""
    for o in outs:
        rid = o.request_id
        if o.codes is not None:
            last = run.last_frame_s.get(rid)
            if measuring and last is not None:
                run.intervals_ms.append((t1 - last) * 1e3)
            run.last_frame_s[rid] = t1
            if measuring:
                run.frames += 1
            if rid in run.initial:
                run.started_initial.add(rid)
        if o.finished:
            run.last_frame_s.pop(rid, None)
            run.finished += int(measuring)
            add(frames)  # the replacement arrives at once: prefill traffic never stops
            run.arrivals += int(measuring)


def _admit(eng: GraphEngine, run: CapacityLevel) -> None:
    """Start the waiting requests while the engine has a free slot."""
    while run.waiting and eng.num_free_slots:
        eng.add(*run.waiting.popleft())


def prefill_backlog(eng: GraphEngine, run: CapacityLevel) -> int:
    """Prompt positions still to prefill: admitted requests' remainders plus the waiting prompts."""
    sched = eng.scheduler
    pending = sum(
        s.num_prefill_positions - s.num_prefilled
        for s in sched.running.values()
        if s.status is SeqStatus.PREFILLING
    )
    return pending + sum(int(prompt.embeds.shape[0]) - 1 for _, prompt, _, _ in run.waiting)


class PrefillCounter:
    """Wraps the runner's `prefill` to count, per step, the prompt positions written, the chunks,
    the distinct requests they belong to and the chunks that complete a prompt."""

    def __init__(self, runner) -> None:
        self.reset()
        self._prefill = runner.prefill
        runner.prefill = self

    def reset(self) -> None:
        self.positions = self.chunks = self.completed = 0
        self.requests: set[str] = set()

    def __call__(self, chunks) -> None:
        self.positions += sum(c.end - c.start for c in chunks)
        self.chunks += len(chunks)
        self.completed += sum(c.end >= c.seq.num_prefill_positions for c in chunks)
        self.requests.update(c.seq.request_id for c in chunks)
        self._prefill(chunks)


def summarize(run: CapacityLevel, warm_steps: int, args: argparse.Namespace) -> dict[str, Any]:
    steps = run.step_ms
    iv = run.intervals_ms or [float("nan")]
    step_med = statistics.median(steps)
    p99 = percentile(iv, 99)
    wall_s = sum(steps) / 1e3
    # A level counts only if the engine actually runs its streams: requests that wait for a slot or
    # for prefill produce no frame intervals, so a backlog would otherwise look like headroom.
    carried = statistics.fmean(run.running_per_step) >= args.min_running_share * run.target
    return {
        "streams": run.target,
        "warmup_steps": warm_steps,
        "measured_steps": len(steps),
        "step_ms_p50": step_med,
        "step_ms_p99": percentile(steps, 99),
        "step_ms_max": max(steps),
        "interval_ms_p50": percentile(iv, 50),
        "interval_ms_p99": p99,
        "interval_ms_max": max(iv),
        "num_intervals": len(run.intervals_ms),
        "p99_interval_over_median_step": p99 / step_med if step_med > 0 else float("nan"),
        "running_per_step_mean": statistics.fmean(run.running_per_step),
        "prefill_positions_per_step_mean": statistics.fmean(run.prefill_per_step),
        "waiting_per_step_mean": statistics.fmean(run.waiting_per_step),
        "prefilling_per_step_mean": statistics.fmean(run.prefilling_per_step),
        "prefill_chunks_per_step": run.prefill_chunks / len(steps),
        "prompts_completed_per_step": run.prefill_completed / len(steps),
        "prefill_positions_per_completed_prompt": (
            sum(run.prefill_per_step) / run.prefill_completed if run.prefill_completed else float("nan")
        ),
        "carried": carried,
        "arrivals": run.arrivals,
        "arrivals_per_step": run.arrivals / len(steps),
        "finished": run.finished,
        "frames": run.frames,
        "audio_s_per_wall_s": run.frames * FRAME_MS / 1e3 / wall_s if wall_s > 0 else float("nan"),
        "real_time": bool(p99 <= args.budget_ms) and carried,
        "ratio_ok": bool(p99 / step_med <= args.max_ratio) if step_med > 0 else False,
    }


def load_bundle(args: argparse.Namespace, workdir: Path):
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from qtts.tiny_model import build_tiny_snapshot

        snap = build_tiny_snapshot(workdir / "qwen3-tts-tiny-base", "base", seed=0)
        return load_talker_bundle(snap, device=args.device, dtype=dtype, load_format="dummy")
    return load_talker_bundle(args.model, device=args.device, dtype=dtype, load_format="dummy")


def engine_config(args: argparse.Namespace, max_streams: int, max_trailing: int) -> GraphEngineConfig:
    ctx_step = args.context_step or (128 if not args.tiny else 16)
    max_len = ctx_step * math.ceil((args.prompt_len + args.frames + 2) / ctx_step)
    runner = RunnerConfig(
        max_len=max_len,
        max_batch=max_streams,
        num_slots=max_streams,
        max_trailing=max(16, max_trailing),
        context_step=ctx_step,
        batch_buckets=tuple(b for b in DEFAULT_BATCH_BUCKETS if b <= max_streams) or (max_streams,),
        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
        prefill_buckets=tuple(int(x) for x in args.prefill_buckets.split(",") if x),
        prefill_rows=tuple(int(x) for x in args.prefill_rows.split(",") if x),
        prefill_packed=None if args.prefill == "auto" else args.prefill == "packed",
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.max_prefill_tokens is None:
        return GraphEngineConfig(runner=runner)
    return GraphEngineConfig(runner=runner, max_prefill_tokens=args.max_prefill_tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Long, kept in one piece: a flag table, then the defaults that depend on --tiny."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen3-tts-12hz-1.7b-base", help="shipped config name or snapshot folder"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny random model and small sizes (CPU smoke run)")
    ap.add_argument("--streams", default=None, help="levels, comma separated (default 64,...,1280)")
    ap.add_argument(
        "--prompt-len", type=int, default=None, help="prompt positions of every request (default 300)"
    )
    ap.add_argument("--frames", type=int, default=None, help="frames per request (default 100 = 8 s)")
    ap.add_argument("--measure-steps", type=int, default=None, help="measured steps per level (default 200)")
    ap.add_argument("--max-warmup-steps", type=int, default=2000)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="prefill positions per step (default: the engine's)",
    )
    ap.add_argument(
        "--min-running-share",
        type=float,
        default=0.95,
        help="a level is carried when this share of its streams produce frames per step on average",
    )
    ap.add_argument("--prompt-pool", type=int, default=64, help="distinct prompts (voices) cycled through")
    ap.add_argument(
        "--prefill-buckets", default="", help="widths of captured prefill graphs, e.g. 64,128,256,512"
    )
    ap.add_argument("--prefill-rows", default="1,2,4,8", help="row buckets of the captured prefill graphs")
    ap.add_argument(
        "--prefill",
        default="auto",
        choices=("auto", "packed", "rows"),
        help="packed prefill (RunnerConfig.prefill_packed; auto: with the fast path) or the per-row one",
    )
    ap.add_argument(
        "--weight-dtype", default="model", choices=("model", "fp8"), help="RunnerConfig.weight_dtype"
    )
    ap.add_argument(
        "--kv-cache-dtype", default="model", choices=("model", "fp8"), help="RunnerConfig.kv_cache_dtype"
    )
    ap.add_argument("--context-step", type=int, default=None, help="attention-span bucket step (default 128)")
    ap.add_argument("--prefix-cache-mb", type=float, default=0.0, help="prefix KV cache (0: off)")
    ap.add_argument(
        "--budget-ms", type=float, default=FRAME_MS, help="p99 frame interval of a real-time level"
    )
    ap.add_argument("--max-ratio", type=float, default=1.5, help="p99 interval / median step target")
    ap.add_argument(
        "--no-stagger", dest="stagger", action="store_false", help="all initial requests equally long"
    )
    ap.add_argument("--sample", dest="greedy", action="store_false", help="sample instead of greedy decoding")
    ap.add_argument(
        "--keep-going", action="store_true", help="run every level even after one missed the budget"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    small = args.tiny
    if args.streams is None:
        args.streams = "2,4" if small else "64,128,256,512,768,1024,1280"
    args.streams = sorted(int(x) for x in str(args.streams).split(",") if x)
    args.prompt_len = args.prompt_len or (24 if small else 300)
    args.frames = args.frames or (6 if small else 100)
    args.measure_steps = args.measure_steps or (12 if small else 200)
    if args.dtype is None:
        args.dtype = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    if min(args.streams) < 1 or args.frames < 1 or args.prompt_len < 11 or args.measure_steps < 1:
        raise SystemExit(
            "--streams >= 1, --frames >= 1, --prompt-len >= 11 and --measure-steps >= 1 required"
        )
    return args


def _run_levels(
    eng: GraphEngine, prompts: list[TalkerPrompt], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """`run_level` for every --streams level in turn, each told on stdout (and the levels so far
    written to --out); stops after the first level that misses the budget unless --keep-going."""
    counter = PrefillCounter(eng.runner)
    levels = []
    for n in args.streams:
        res = run_level(eng, counter, prompts, n, args)
        levels.append(res)
        if args.out:  # levels so far, in case a time limit cuts the run
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"partial": True, "levels": levels}, indent=2))
        print_level(n, res)
        if not res["real_time"] and not args.keep_going:
            break
    return levels


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("talker_capacity needs a CUDA GPU (or --device cpu --tiny)")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        bundle = load_bundle(args, Path(tmp))
        load_s = time.perf_counter() - t0
    prompts = build_prompts(bundle, args.prompt_pool, args.prompt_len)
    t0 = time.perf_counter()
    max_trailing = max(int(p.trailing.shape[0]) for p in prompts)
    eng = GraphEngine(bundle, config=engine_config(args, max(args.streams), max_trailing))
    start_s = time.perf_counter() - t0
    levels = _run_levels(eng, prompts, args)
    passing = [r["streams"] for r in levels if r["real_time"]]
    result = {
        "meta": {
            "model": "tiny" if args.tiny else args.model,
            "device": torch.cuda.get_device_name()
            if str(args.device).startswith("cuda")
            else platform.processor() or "cpu",
            "dtype": args.dtype,
            "torch": torch.__version__,
            "git": git_revision(),
            "host": platform.node(),
            "weights": "dummy (seeded random)",
            "tokenizer": bundle.tokenizer_name,
            "load_s": load_s,
            "engine_start_s": start_s,
            "num_slots": eng.max_batch,
            "prefill_packed": eng.runner.prefill_packed,
            "fused_qkv_attention": eng.runner.fused_qkv,
            "max_len": eng.config.runner.max_len,
        },
        "settings": {
            "streams": args.streams,
            "prompt_len": int(prompts[0].embeds.shape[0]),
            "frames_per_request": args.frames,
            "measure_steps": args.measure_steps,
            "max_prefill_tokens": args.max_prefill_tokens,
            "prefix_cache_mb": args.prefix_cache_mb,
            "prefill": args.prefill,
            "weight_dtype": args.weight_dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
            "greedy": args.greedy,
        },
        "budget_ms": args.budget_ms,
        "max_ratio": args.max_ratio,
        "levels": levels,
        "max_realtime_streams": max(passing) if passing else 0,
    }
    print_table(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
