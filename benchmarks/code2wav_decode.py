"""GPU benchmark of the code2wav decode engine (`qtts.decode_engine`) on the full-size decoder.

Full-size speech-tokenizer decoder from `configs/speech_tokenizer` with seeded random weights
(`--load-format dummy` semantics: the same compute as real weights). Every variant
(`--precisions` x `--conv-stacks`, default bf16 with CUDA graphs and each of the three conv stacks:
channels-first, the reference; channels-last; channels-last fused) is measured in one run:

1. steady state: microseconds per frame per stream and audio seconds decoded per GPU second (xRT)
   at 128 / 512 / 1,024 concurrent streams, every stream past the 72-frame window, one
   `--chunk`-frame chunk per stream per engine call (`decode_batch`, host work and sync included);
2. SNR against the strict fp32 reference engine (channels-first, eager) on the same codes;
3. first-chunk latency at batch 1: a 1-4 frame first chunk of a fresh stream (wall time of
   `decode`, sync included), and `start` with an ICL prefix;
4. a per-kernel GPU time profile of one eager step per variant (`--no-profile` skips it);
5. with `--stateless`: cost per new frame of a 4- and a 25-frame chunk, stateful vs a stateless
   decode that re-decodes `--context` left-context frames (GPU time of the captured steps).

A short table compares the variants; `--out` writes everything as JSON.

    python -m benchmarks.code2wav_decode --out run/code2wav_decode.json
    python -m benchmarks.code2wav_decode --quick   # smaller sweep, a minute or two
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.revision import git_revision
from benchmarks.timing import median_event_s, median_wall_s, sync
from qtts.decode_engine import SlotDecoder, SlotDecoderConfig
from qtts.decode_engine.runner import CONV_STACKS, PRECISIONS
from qtts.model.codec_decoder import CodecDecoder, load_codec_decoder

REPO_ROOT = Path(__file__).resolve().parent.parent
FRAME_SECONDS = 0.08


def _codes(frames: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (frames, 16), generator=g).to(device)


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum().item()
    return float("inf") if noise == 0 else 10.0 * torch.log10(ref.pow(2).sum() / noise).item()


def _engine(
    dec: CodecDecoder,
    precision: str,
    graphs: bool,
    streams: int,
    chunks: Sequence[int],
    batches: Sequence[int],
    max_step_frames: int,
    extra: Sequence[tuple[int, int]] = (),
    conv_stack: str = "channels_first",
    cudnn_benchmark: bool = True,
) -> SlotDecoder:
    cfg = SlotDecoderConfig(
        max_streams=streams,
        precision=precision,
        conv_stack=conv_stack,
        cuda_graphs=graphs,
        batch_sizes=tuple(batches),
        chunk_sizes=tuple(chunks),
        max_step_frames=max_step_frames,
        cudnn_benchmark=cudnn_benchmark,
    )
    eng = SlotDecoder(dec, cfg)
    t0 = time.perf_counter()
    n = eng.capture(extra) if graphs else 0
    print(
        f"[{precision} {conv_stack} graphs={graphs}] captured {n} shapes in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return eng


def steady_state(eng: SlotDecoder, streams: Sequence[int], chunk: int, iters: int) -> list[dict]:
    """Audio seconds per GPU second with `b` streams each decoding `chunk` frames per call."""
    rows = []
    for b in streams:
        states = [eng.start() for _ in range(b)]
        codes = [_codes(chunk, seed=i) for i in range(b)]
        # Every stream past the attention window: the sliding (steady) phase.
        while states[0].frames < eng.window + 1:
            eng.decode_batch(states, codes)
        sync()
        t = median_wall_s(lambda states=states, codes=codes: eng.decode_batch(states, codes), iters)
        audio = b * chunk * FRAME_SECONDS
        rows.append(
            {
                "streams": b,
                "chunk_frames": chunk,
                "seconds_per_call": t,
                "xrt": audio / t,
                "us_per_frame_per_stream": t / (b * chunk) * 1e6,
            }
        )
        print(
            f"  streams={b:4d} chunk={chunk}: {t * 1e3:8.2f} ms/call  {audio / t:8.0f}x real time  "
            f"{t / (b * chunk) * 1e6:6.1f} us/frame",
            flush=True,
        )
        for s in states:
            eng.free(s)
    return rows


def snr_against(ref_eng: SlotDecoder, eng: SlotDecoder, n_streams: int = 4) -> float:
    plan = [2, 4, 4, 8, 16, 25, 25, 16]
    total = sum(plan)
    refs, outs = [], []
    for e, dst in ((ref_eng, refs), (eng, outs)):
        for i in range(n_streams):
            s = e.start(_codes(20, seed=100 + i) if i % 2 else None)
            c = _codes(total, seed=200 + i)
            pieces, off = [], 0
            for n in plan:
                pieces.append(e.decode(s, c[off : off + n]).float().cpu())
                off += n
            dst.append(torch.cat(pieces))
            e.free(s)
    return snr_db(torch.cat(refs), torch.cat(outs))


def stateful_vs_stateless(
    eng: SlotDecoder, batch: int, chunks: Sequence[int], contexts: Sequence[int], iters: int
) -> list[dict]:
    """GPU time per new frame: a captured n-frame step vs a captured (context + n)-frame step
    (what a stateless decoder that re-decodes left context computes; timing is data-independent)."""
    run = eng.runner
    states = [eng.start() for _ in range(batch)]
    slots = [s.slot for s in states]
    rows = []

    def step_time(frames: int) -> float:
        codes = [_codes(frames, seed=i) for i in range(batch)]
        positions = [eng.window + 1] * batch
        if run.has_graph(batch, frames):
            return median_event_s(lambda: run.run_static(batch, slots, positions, codes), iters)
        return median_event_s(lambda: run.run_eager(slots, positions, codes), iters)

    for n in chunks:
        t_state = step_time(n)
        row = {"batch": batch, "chunk_frames": n, "stateful_us_per_new_frame": t_state / (batch * n) * 1e6}
        for ctx in contexts:
            t_less = step_time(ctx + n)
            row[f"stateless_ctx{ctx}_us_per_new_frame"] = t_less / (batch * n) * 1e6
            row[f"ratio_ctx{ctx}"] = t_less / t_state
        rows.append(row)
        print(
            "  " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
    for s in states:
        eng.free(s)
    return rows


def kernel_profile(eng: SlotDecoder, batch: int, chunk: int, top: int = 12) -> list[dict]:
    """GPU time by kernel of one eager step (batch x chunk frames, past the window): where a
    variant spends its frame. Eager, so every kernel is visible; the graph replays the same ones."""
    if not torch.cuda.is_available():
        return []
    from torch.profiler import ProfilerActivity, profile

    run = eng.runner
    states = [eng.start() for _ in range(batch)]
    slots, positions = [s.slot for s in states], [eng.window + 1] * batch
    codes = [_codes(chunk, seed=i) for i in range(batch)]
    try:
        for _ in range(2):
            run.run_eager(slots, positions, codes)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run.run_eager(slots, positions, codes)
            sync()
        # Kernels only (an operator's device time would count its kernels twice).
        events = [
            e for e in prof.key_averages() if str(e.device_type).endswith("CUDA") and e.device_time_total > 0
        ]
    except Exception as e:  # a profiler that cannot start must not cost the timing results
        print(f"  profile skipped: {e}", flush=True)
        return []
    finally:
        for s in states:
            eng.free(s)
    total = sum(e.device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    rows = [
        {
            "kernel": e.key[:90],
            "calls": e.count,
            "us_per_frame": e.device_time_total / (batch * chunk),
            "share": e.device_time_total / total,
        }
        for e in events[:top]
    ]
    print(f"  step total {total / (batch * chunk):.2f} us a frame (eager, kernels only)")
    for r in rows:
        print(f"  {r['us_per_frame']:7.2f} us/f {100 * r['share']:5.1f}% x{r['calls']:<4d} {r['kernel']}")
    return rows


def first_chunk_latency(eng: SlotDecoder, iters: int, prefix_frames: int) -> list[dict]:
    """Wall time of `decode` of a fresh stream's 1-4 frame first chunk (sync included)."""
    rows = []
    for n in (1, 2, 3, 4):
        codes = _codes(n, seed=n)
        times: list[float] = []
        for i in range(iters + 3):
            s = eng.start()
            sync()
            t0 = time.perf_counter()
            eng.decode(s, codes)
            sync()
            if i >= 3:  # warm-up
                times.append(time.perf_counter() - t0)
            eng.free(s)
        rows.append({"first_chunk_frames": n, "decode_ms": statistics.median(times) * 1e3})
    # A new reference prefix every call (decoded: a voice seen for the first time), then one
    # prefix again and again (its state copied from the prefix-state cache: a known voice).
    seeds = iter(range(1000, 10**9))

    def icl_start(prefix: torch.Tensor | None = None) -> None:
        s = eng.start(prefix if prefix is not None else _codes(prefix_frames, seed=next(seeds)))
        eng.free(s)

    t = median_wall_s(icl_start, max(3, iters // 4))
    known = _codes(prefix_frames, seed=7)
    t_known = median_wall_s(lambda: icl_start(known), max(3, iters // 4))
    rows.append(
        {"icl_prefix_frames": prefix_frames, "start_ms": t * 1e3, "start_known_voice_ms": t_known * 1e3}
    )
    for r in rows:
        print(
            "  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
            flush=True,
        )
    return rows


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (with --quick applied)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="qwen3-tts-12hz-1.7b-base",
        help="speech tokenizer folder, or a shipped config name (dummy weights)",
    )
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--chunk", type=int, default=16, help="steady-state chunk frames")
    p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISIONS)
    p.add_argument(
        "--conv-stacks",
        nargs="+",
        # The new stacks first: a run cut short by a time limit keeps them (the reference's
        # figures are known from earlier runs).
        default=list(reversed(CONV_STACKS)),
        choices=CONV_STACKS,
        help="conv stack layouts to compare (each with every precision)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="precision:conv_stack pairs to measure instead of --precisions x --conv-stacks",
    )
    p.add_argument("--eager", action="store_true", help="also measure the eager (no graph) engine")
    p.add_argument("--stateless", action="store_true", help="also compare with stateless re-decoding")
    p.add_argument(
        "--no-profile", dest="profile", action="store_false", help="skip the per-kernel profile of a step"
    )
    p.add_argument("--cost-batch", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="+", default=[12, 25])
    p.add_argument("--prefix-frames", type=int, default=75, help="ICL prefix for the start() latency")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-step-frames", type=int, default=3200)
    p.add_argument(
        "--cudnn-benchmark",
        choices=("on", "off"),
        default="on",
        help="let cuDNN time each convolution's algorithms at capture (code2wav's default), or use its "
        "heuristics; the capture time of each variant is recorded (run each setting in a fresh process: "
        "cuDNN keeps its choices for the process)",
    )
    p.add_argument("--quick", action="store_true", help="fewer iterations and stream counts")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--revision", default=None, help="git revision to record (default: git rev-parse)")
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = [(pr, cs) for pr in args.precisions for cs in args.conv_stacks]
    else:
        pairs = [tuple(v.partition(":")[::2]) for v in args.variants]
        bad = [
            v
            for v, (pr, cs) in zip(args.variants, pairs, strict=True)
            if pr not in PRECISIONS or cs not in CONV_STACKS
        ]
        if bad:
            p.error(f"--variants: {bad} are not precision:conv_stack ({PRECISIONS} x {CONV_STACKS})")
        args.variants = pairs
    if args.quick:
        args.streams, args.iters = [s for s in args.streams if s in (1, 32, 128)] or args.streams[:1], 5
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    torch.manual_seed(0)
    dec = load_codec_decoder(args.model, device=args.device, load_format=args.load_format)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "git": args.revision or git_revision(),
        "weights": "dummy (seeded random)",
        "decoder": "full-size speech tokenizer decoder (configs/speech_tokenizer)",
        "chunk_frames": args.chunk,
        "max_step_frames": args.max_step_frames,
        "cudnn_benchmark": args.cudnn_benchmark,
        "capture_s": {},
        "steady_state": {},
        "snr_db": {},
        "stateful_vs_stateless": {},
        "first_chunk": {},
        "kernel_profile": {},
        "errors": {},
    }
    _measure(dec, args, result)
    result["summary"] = _summary(args, result)
    _print_summary(args, result)
    _save(args, result)
    if args.out:
        print(f"wrote {args.out}")
    return 1 if result["errors"] else 0


def _measure(dec: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Every variant (graph, and eager with --eager) against the fp32 reference, into `result`.

    A variant that fails is recorded under "errors" and the others still run; with --out the JSON
    is rewritten after every variant, so a run cut short keeps what it measured."""
    ref = _engine(dec, "fp32", False, 8, (), (), args.max_step_frames)
    for precision, conv_stack in args.variants:
        for graphs in (True, False) if args.eager else (True,):
            key = f"{precision}_{conv_stack}_{'graph' if graphs else 'eager'}"
            try:
                _measure_variant(dec, ref, args, result, key, precision, conv_stack, graphs)
            except Exception as e:  # one broken variant must not cost the others' numbers
                traceback.print_exc()
                result["errors"][key] = repr(e)
                print(f"== {key}: FAILED {e!r}", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            _save(args, result)


def _measure_variant(
    dec: Any,
    ref: SlotDecoder,
    args: argparse.Namespace,
    result: dict[str, Any],
    key: str,
    precision: str,
    conv_stack: str,
    graphs: bool,
) -> None:
    stream_cap = max(max(args.streams), args.cost_batch)
    # Only the buckets a step can use: wider ones exceed --max-step-frames at this chunk (the
    # planner splits them), and capturing them costs minutes of cuDNN autotuning.
    batches = sorted(
        b for b in set(args.streams) | {args.cost_batch, 1, 2, 4} if b * args.chunk <= args.max_step_frames
    )
    cost_chunks = (4, 25)
    stateless = sorted({c + n for c in args.contexts for n in cost_chunks})
    chunks = sorted({1, 2, 3, 4, args.chunk, *(cost_chunks if args.stateless else ())})
    # The stateless comparison's longer steps, captured at the cost batch only.
    extra = [(args.cost_batch, f) for f in stateless if f <= 72] if args.stateless else []
    t0 = time.perf_counter()
    eng = _engine(
        dec,
        precision,
        graphs,
        stream_cap,
        chunks if graphs else (),
        batches if graphs else (),
        args.max_step_frames,
        extra if graphs else (),
        conv_stack=conv_stack,
        cudnn_benchmark=args.cudnn_benchmark == "on",
    )
    result["capture_s"][key] = round(time.perf_counter() - t0, 2)
    print(f"== {key}: steady state", flush=True)
    result["steady_state"][key] = steady_state(eng, args.streams, args.chunk, args.iters)
    if not graphs:
        return
    result["snr_db"][key] = snr_against(ref, eng)
    print(f"  SNR {key} vs fp32: {result['snr_db'][key]:.1f} dB", flush=True)
    if args.stateless:
        print(f"== {key}: stateful vs stateless (batch {args.cost_batch})", flush=True)
        result["stateful_vs_stateless"][key] = stateful_vs_stateless(
            eng, args.cost_batch, cost_chunks, args.contexts, args.iters
        )
    print(f"== {key}: first chunk at batch 1", flush=True)
    result["first_chunk"][key] = first_chunk_latency(eng, args.iters, args.prefix_frames)
    if args.profile:
        print(f"== {key}: kernel profile (batch {args.cost_batch}, chunk {args.chunk})", flush=True)
        result["kernel_profile"][key] = kernel_profile(eng, args.cost_batch, args.chunk)


def _save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


def _summary(args: argparse.Namespace, result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured variant: us/frame and xRT per stream count, SNR, first chunk."""
    rows = []
    for key, steady in result["steady_state"].items():
        row: dict[str, Any] = {"variant": key}
        for r in steady:
            row[f"us_per_frame_{r['streams']}"] = r["us_per_frame_per_stream"]
            row[f"xrt_{r['streams']}"] = r["xrt"]
        row["snr_db"] = result["snr_db"].get(key)
        first = result["first_chunk"].get(key, [])
        row["first_chunk_1f_ms"] = next(
            (r["decode_ms"] for r in first if r.get("first_chunk_frames") == 1), None
        )
        rows.append(row)
    return rows


def _print_summary(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The comparison table: per-frame cost and xRT per stream count, SNR, first chunk."""
    print(f"\nsteady state, chunk {args.chunk} frames, max {args.max_step_frames} frames a step")
    head = ["variant"] + [f"us/f@{b}" for b in args.streams] + [f"xRT@{b}" for b in args.streams]
    head += ["SNR dB", "1st 1f ms"]
    print(" | ".join(head))
    for row in result["summary"]:
        cells = [row["variant"]]
        cells += [f"{row.get(f'us_per_frame_{b}', float('nan')):.1f}" for b in args.streams]
        cells += [f"{row.get(f'xrt_{b}', float('nan')):.0f}" for b in args.streams]
        cells.append("-" if row["snr_db"] is None else f"{row['snr_db']:.1f}")
        cells.append("-" if row["first_chunk_1f_ms"] is None else f"{row['first_chunk_1f_ms']:.2f}")
        print(" | ".join(cells))
    for key, err in result["errors"].items():
        print(f"{key}: FAILED {err}")


if __name__ == "__main__":
    sys.exit(main())
