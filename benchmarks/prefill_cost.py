"""Prefill cost per prompt position: the per-row prefill against the packed prefill, 1 to 16 prompts.

Full-size talker with seeded random weights (`--load-format dummy`), prompts of `--prompt-len`
positions (random embeddings) prefilled into their own slots in one `ModelRunner.prefill` call:

- rows: the per-row path (`prefill_packed=False`) with the width x row graphs of the H200 runs
  (`--row-buckets`, `--row-rows`; a width bucket per chunk, padded, row buckets of a group);
- packed: all chunks on one token axis, graphed at the token bucket that holds them (eager above
  the largest: `RunnerConfig.prefill_token_buckets`);
- packed_eager: the same packed layers without graphs;
- continuing: the packed call for the second halves of the prompts (chunks that start mid-prompt
  and attend to the keys of the first halves, as the step budget splits prompts);
- gemm: only the four GEMMs per layer at the same token count, in a graph (the pace the issue
  asks for), and floor: the linear FLOPs at 690 TFLOP/s.

Every figure is the median wall time of the call, synchronised, in microseconds per position;
`kv_max_abs_diff` compares the KV of the packed and per-row paths.

    python3 -m benchmarks.prefill_cost --out benchmarks/results/prefill_cost.json
    python3 -m benchmarks.prefill_cost --device cpu --tiny        # smoke run, no timing meaning
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.revision import git_revision
from benchmarks.timing import median_wall_s
from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import load_talker_bundle

BF16_FLOPS_PER_S = 690e12


def runner_config(args: argparse.Namespace, packed: bool) -> RunnerConfig:
    slots = max(args.prompts)
    return RunnerConfig(
        max_len=args.max_len,
        max_batch=slots,
        num_slots=slots,
        max_trailing=4,
        batch_buckets=(slots,),
        prefill_packed=packed,
        prefill_buckets=() if packed else tuple(args.row_buckets),
        prefill_rows=tuple(args.row_rows),
        fast_path=True,
    )


def make_seqs(runner: ModelRunner, count: int, prompt_len: int, seed: int) -> list[Sequence]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    seqs = []
    for i in range(count):
        prompt = type("Prompt", (), {})()
        prompt.embeds = (torch.randn(prompt_len, runner.hidden, generator=g) * 0.02).to(
            runner.device, runner.dtype
        )
        seq = Sequence(f"p{i}", prompt, None, seed=i, max_frames=1, cap_reason="length")
        seq.slot = i
        seqs.append(seq)
    return seqs


def capture_prefill(runner: ModelRunner) -> None:
    """The runner's prefill graphs only (no frame-step graphs: this measures prefill)."""
    if not runner.use_graphs:
        return
    with torch.inference_mode():
        pool = runner._capture_packed(None)
        if runner.prefill_buckets:
            runner._capture_prefill(pool)
    torch.cuda.synchronize()


def linear_flops_per_position(runner: ModelRunner) -> int:
    return 2 * sum(
        w.w_qkv.numel() + w.w_o.numel() + w.w_gate_up.numel() + w.w_down.numel()
        for w in runner.talker_weights
    )


def gemm_us(runner: ModelRunner, tokens: int, iters: int) -> float:
    """The talker's four GEMMs per layer at `tokens` rows, in one graph (CUDA), per call."""
    x = torch.randn(tokens, runner.hidden, device=runner.device, dtype=runner.dtype) * 0.02
    ws = runner.talker_weights
    inter = ws[0].w_down.shape[1]
    attn = torch.randn(tokens, ws[0].w_o.shape[1], device=runner.device, dtype=runner.dtype) * 0.02
    act = torch.randn(tokens, inter, device=runner.device, dtype=runner.dtype) * 0.02

    def run():
        for w in ws:
            F.linear(x, w.w_qkv)
            F.linear(attn, w.w_o)
            F.linear(x, w.w_gate_up)
            F.linear(act, w.w_down)

    if runner.device.type != "cuda":
        return median_wall_s(run, iters) * 1e6
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return median_wall_s(graph.replay, iters) * 1e6


def measure(rows: ModelRunner, packed: ModelRunner, count: int, args: argparse.Namespace) -> dict[str, Any]:
    seqs = make_seqs(packed, count, args.prompt_len, seed=count)
    whole = [PrefillChunk(s, 0, args.prompt_len) for s in seqs]
    half = args.prompt_len // 2
    first, second = (
        [PrefillChunk(s, 0, half) for s in seqs],
        [PrefillChunk(s, half, args.prompt_len) for s in seqs],
    )
    positions = count * args.prompt_len
    with torch.inference_mode():
        rows_us = median_wall_s(lambda: rows.prefill(whole), args.iters) * 1e6
        packed_us = median_wall_s(lambda: packed.prefill(whole), args.iters) * 1e6
        diff = (
            (
                packed.k_cache[:, :count, :, : args.prompt_len].float()
                - rows.k_cache[:, :count, :, : args.prompt_len].float()
            )
            .abs()
            .max()
            .item()
        )
        graphs, packed.packed_graphs = packed.packed_graphs, {}
        eager_us = median_wall_s(lambda: packed.prefill(whole), args.iters) * 1e6
        packed.packed_graphs = graphs
        packed.prefill(first)
        cont_us = median_wall_s(lambda: packed.prefill(second), args.iters) * 1e6
        gemm = gemm_us(packed, positions, args.iters)
    floor_us = linear_flops_per_position(packed) * positions / BF16_FLOPS_PER_S * 1e6
    bucket = next((b for b in packed.packed_token_buckets if b >= positions), None) if graphs else None
    return {
        "prompts": count,
        "prompt_len": args.prompt_len,
        "positions": positions,
        "packed_token_bucket": bucket,
        "rows_us_per_pos": rows_us / positions,
        "packed_us_per_pos": packed_us / positions,
        "packed_eager_us_per_pos": eager_us / positions,
        "continuing_us_per_pos": cont_us / (count * (args.prompt_len - half)),
        "gemm_us_per_pos": gemm / positions,
        "floor_us_per_pos": floor_us / positions,
        "rows_ms": rows_us / 1e3,
        "packed_ms": packed_us / 1e3,
        "speedup": rows_us / packed_us,
        "kv_max_abs_diff": diff,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke run)")
    ap.add_argument("--prompts", default="1,2,4,8,16", help="prompt counts, comma separated")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--row-buckets",
        default="320",
        help="per-row path widths (300-position chunks take 320 among the H200 runs' 64,...,512 too; "
        "fewer widths, fewer graphs to capture)",
    )
    ap.add_argument("--row-rows", default="1,2,4,8", help="per-row path row buckets")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.prompts = [int(x) for x in args.prompts.split(",") if x]
    args.row_buckets = [int(x) for x in args.row_buckets.split(",") if x]
    args.row_rows = [int(x) for x in args.row_rows.split(",") if x]
    if args.tiny:
        args.prompt_len, args.max_len, args.iters = min(args.prompt_len, 24), 32, 2
        args.row_buckets = [8, 16, 32]
    return args


def load(args: argparse.Namespace, workdir: Path):
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.tiny:
        from qtts.tiny_model import build_tiny_snapshot

        snap = build_tiny_snapshot(workdir / "qwen3-tts-tiny-base", "base", seed=0)
        return load_talker_bundle(snap, device=args.device, dtype=dtype, load_format="dummy")
    return load_talker_bundle(args.model, device=args.device, dtype=dtype, load_format="dummy")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("prefill_cost needs a CUDA GPU (or --device cpu --tiny)")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = load(args, Path(tmp))
    rows = ModelRunner(bundle, runner_config(args, packed=False))
    packed = ModelRunner(bundle, runner_config(args, packed=True))
    capture_prefill(rows)
    capture_prefill(packed)
    results = []
    for count in args.prompts:
        r = measure(rows, packed, count, args)
        results.append(r)
        print(
            f"{count:3d} x {args.prompt_len}: rows {r['rows_us_per_pos']:.2f} us/pos, packed "
            f"{r['packed_us_per_pos']:.2f} (eager {r['packed_eager_us_per_pos']:.2f}, continuing "
            f"{r['continuing_us_per_pos']:.2f}), gemm {r['gemm_us_per_pos']:.2f}, floor {r['floor_us_per_pos']:.2f}; "
            f"x{r['speedup']:.2f}, kv diff {r['kv_max_abs_diff']:.3g}",
            flush=True,
        )
    out = {
        "meta": {
            "model": "tiny" if args.tiny else args.model,
            "device": torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else platform.processor() or "cpu",
            "dtype": str(packed.dtype),
            "torch": torch.__version__,
            "git": git_revision(),
            "weights": "dummy (seeded random)",
            "fused_decode": packed.fused_decode,
            "token_buckets": list(packed.packed_token_buckets),
            "row_buckets": args.row_buckets,
            "row_rows": args.row_rows,
            "goal_us_per_pos_at_8": 6.0,
        },
        "results": results,
    }
    print(
        "\n| prompts | positions | rows us/pos | packed us/pos | packed eager | continuing | gemm only | floor | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['prompts']} | {r['positions']} | {r['rows_us_per_pos']:.2f} | {r['packed_us_per_pos']:.2f} | "
            f"{r['packed_eager_us_per_pos']:.2f} | {r['continuing_us_per_pos']:.2f} | {r['gemm_us_per_pos']:.2f} | "
            f"{r['floor_us_per_pos']:.2f} | {r['speedup']:.2f} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
