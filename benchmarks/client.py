"""Command line benchmark of the TTS gateway: closed-loop concurrency sweeps or open-loop Poisson
load over HTTP or gRPC, written as JSON + Markdown + PNG plots.

    python -m benchmarks.client --concurrency 1 8 32 64 --num-requests 64 --out run/bench/sweep
    python -m benchmarks.client --rate 2 5 10 --duration 60 --protocol grpc
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

# The command line and the recorded conditions live beside this module; the names tests and
# scripts take from `benchmarks.client` are re-exported here.
from benchmarks.client_conditions import conditions, frames_text
from benchmarks.client_conditions import local_gpu as local_gpu
from benchmarks.client_conditions import served_models as served_models
from benchmarks.client_config import DEFAULT_PROMPTS as DEFAULT_PROMPTS
from benchmarks.client_config import BenchConfig
from benchmarks.client_config import build_parser as _build_parser
from benchmarks.client_config import read_prompts as read_prompts
from benchmarks.client_config import voice_pool as voice_pool
from benchmarks.loadgen import (
    LevelRun,
    length_stats,
    poisson_arrivals,
    retry_after_backoff,
    run_closed_loop,
    run_open_loop,
)
from benchmarks.metrics import RequestRecord
from benchmarks.multiproc import LevelSpec
from benchmarks.multiproc import run_level as run_level_in_processes
from benchmarks.refusal_probe import probe_until
from benchmarks.report import (
    gap_free_lines,
    highest_gap_free_load,
    level_result,
    markdown_table,
    write_report,
)
from benchmarks.transport import (
    POOL_WARM_INDEX,
    GrpcSynthesizer,
    HttpSynthesizer,
    SynthesisOptions,
    Synthesizer,
    warm_or_log,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    """The flag table of `tts-bench` (benchmarks.client_config), described by this module's docstring."""
    return _build_parser(__doc__)


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


def make_synthesizer(cfg: BenchConfig) -> Synthesizer:
    """One synthesizer per gateway the comma-separated --url or --grpc-target names, taken in turn."""
    args = cfg.args
    if args.protocol == "grpc":
        targets, make = (
            args.grpc_target,
            lambda t: GrpcSynthesizer(
                t, cfg.options, channels=args.grpc_channels, request_id_prefix=args.tag
            ),
        )
    else:
        targets, make = args.url, lambda u: HttpSynthesizer(u, cfg.options)
    made = [make(t) for t in ([t.strip() for t in targets.split(",") if t.strip()] or [targets])]
    return RoundRobinSynthesizer(made) if len(made) > 1 else made[0]


class RoundRobinSynthesizer:
    """Request i goes to synthesizer i mod n (one per gateway URL or gRPC target), as a Service
    spreads streams over gateway pods; the records do not say which gateway served them."""

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


# Probe requests' indices within a level (each level's requests count from level_no * 1,000,000).
PROBE_INDEX_OFFSET = 900_000


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
        level_run = asyncio.ensure_future(
            asyncio.to_thread(run_level_in_processes, args, spec, args.processes, deadline, level_sender)
        )
        probe = None
        if getattr(args, "refusal_probe_s", 0.0) > 0:
            first = level_no * 1_000_000 + PROBE_INDEX_OFFSET
            probe = await probe_until(synthesizer, level_run, every_s=args.refusal_probe_s, first_index=first)
        run = await level_run
    else:
        send = make_send(cfg, synthesizer, level_no * 1_000_000, total)
        with tqdm(total=total, desc=label, unit="req", disable=args.no_progress, file=sys.stderr) as bar:
            on_done = lambda _record: bar.update(1)  # noqa: E731
            if mode == "closed":
                backoff = retry_after_backoff if getattr(args, "retry_after", False) else None
                run: LevelRun = await run_closed_loop(
                    send,
                    concurrency=concurrency,
                    num_requests=total,
                    deadline=deadline,
                    on_done=on_done,
                    backoff=backoff,
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
        if probe is not None:
            level["probe"] = probe
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
