"""Where the talker's frame step spends its time on the GPU: phases and kernels.

Builds the full-size talker with seeded random weights (`--load-format dummy`), captures the frame
step at a few batch buckets, and reports per bucket:

- the whole step (CUDA graph replay, CUDA events), the talker decode alone, the talker decode plus
  codebook-0 head and sampling, and by difference the 15-step code predictor with its sampling;
- from `torch.profiler` over graph replays: kernels per step, the summed kernel time per step (the
  rest of the replay time is launch gaps between kernels), and the kernels that take the most time;
- the graphed prefill of one `--prompt-len` prompt, profiled the same way.

    python -m benchmarks.talker_profile --out run/talker_profile.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.revision import git_revision
from benchmarks.talker_step import fill_slots
from benchmarks.timing import median_event_s
from qtts.engine.model_runner import (
    DEFAULT_BATCH_BUCKETS,
    I_POS,
    ModelRunner,
    RunnerConfig,
)
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import load_talker_bundle


def _capture(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_profile(fn, steps: int, top: int) -> dict[str, Any]:
    """Kernels launched by `steps` calls of `fn` (graph replays are traced kernel by kernel)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels.setdefault(e.name, []).append(e.device_time)
    count = sum(len(v) for v in kernels.values())
    total_us = sum(sum(v) for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernels_per_step": count / steps,
        "kernel_us_per_step": total_us / steps,
        "top": [
            {"name": k[:120], "per_step": len(v) / steps, "us_per_step": sum(v) / steps} for k, v in ranked
        ],
    }


def bench_bucket(runner: ModelRunner, n: int, ctx: int, args: argparse.Namespace) -> dict[str, Any]:
    runner.active[:n] = True

    def talker_only():
        runner._talker_decode(n, ctx)

    def talker_c0():
        runner._codebook0(runner._talker_decode(n, ctx), n, runner._frame_uniforms(n))

    def reset():
        runner.slot_ints[:, I_POS] = args.position

    with torch.inference_mode():
        full = runner.graphs[(n, ctx)]
        g_talk = _capture(talker_only)
        g_c0 = _capture(talker_c0)
        res: dict[str, Any] = {"bucket": n, "context": ctx}
        for name, g in (("step_ms", full), ("talker_ms", g_talk), ("talker_c0_ms", g_c0)):
            reset()
            res[name] = median_event_s(g.replay, args.iters, 3) * 1e3
        res["predictor_ms"] = res["step_ms"] - res["talker_c0_ms"]
        res["c0_head_sample_ms"] = res["talker_c0_ms"] - res["talker_ms"]
        reset()
        res["profile"] = kernel_profile(full.replay, args.profile_steps, args.top)
        reset()
        res["talker_profile"] = kernel_profile(g_talk.replay, args.profile_steps, args.top)
        del g_talk, g_c0
    runner.active.zero_()
    print(
        f"B={n:5d}: step {res['step_ms']:.2f} ms = talker {res['talker_ms']:.2f} + c0 head/sample "
        f"{res['c0_head_sample_ms']:.2f} + predictor {res['predictor_ms']:.2f}; kernels/step "
        f"{res['profile']['kernels_per_step']:.0f} ({res['profile']['kernel_us_per_step'] / 1e3:.2f} ms of kernel time); "
        f"talker kernels {res['talker_profile']['kernels_per_step']:.0f}",
        flush=True,
    )
    return res


def bench_prefill(runner: ModelRunner, args: argparse.Namespace) -> dict[str, Any]:
    prompt = type("P", (), {})()
    prompt.embeds = torch.randn(args.prompt_len, runner.hidden, device="cuda", dtype=runner.dtype) * 0.02
    seq = Sequence("p", prompt, None, seed=0, max_frames=1, cap_reason="length")
    seq.slot = 0
    chunks = [PrefillChunk(seq, 0, seq.num_prefill_positions)]
    with torch.inference_mode():
        ms = median_event_s(lambda: runner.prefill(chunks), args.iters, 3) * 1e3
        prof = kernel_profile(lambda: runner.prefill(chunks), 5, args.top)
    print(
        f"prefill {args.prompt_len}: {ms:.2f} ms, kernels {prof['kernels_per_step']:.0f} "
        f"({prof['kernel_us_per_step'] / 1e3:.2f} ms of kernel time)",
        flush=True,
    )
    return {"prompt_len": args.prompt_len, "ms": ms, "profile": prof}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--buckets", default="2,8,256,1024")
    ap.add_argument("--position", type=int, default=300)
    ap.add_argument("--context-bucket", type=int, default=384)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--prefill-buckets", default="128,256,384")
    ap.add_argument("--talker-attention", default="auto")
    ap.add_argument("--max-candidates", type=int, default=None)
    ap.add_argument(
        "--decode-kernels", default="auto", help="auto, triton or torch (RunnerConfig.decode_kernels)"
    )
    ap.add_argument(
        "--sample-kernel", default="auto", help="auto, triton or torch (RunnerConfig.sample_kernel)"
    )
    ap.add_argument(
        "--skinny-matmul",
        default="auto",
        choices=("auto", "on", "off"),
        help="few-row matmuls on the Triton skinny kernel (RunnerConfig.skinny_matmul)",
    )
    ap.add_argument(
        "--weight-dtype", default="model", choices=("model", "fp8"), help="RunnerConfig.weight_dtype"
    )
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    return args


def _runner(args: argparse.Namespace, buckets: list[int]) -> ModelRunner:
    """The runner (dummy bf16 weights) with its graphs captured and every slot filled to --position."""
    bundle = load_talker_bundle(args.model, device="cuda", dtype=torch.bfloat16, load_format="dummy")
    cfg = RunnerConfig(
        max_len=args.context_bucket,
        max_batch=max(buckets),
        num_slots=max(buckets),
        max_trailing=64,
        batch_buckets=tuple(b for b in DEFAULT_BATCH_BUCKETS if b in buckets) or tuple(buckets),
        context_buckets=(args.context_bucket,),
        talker_attention=args.talker_attention,
        max_candidates=args.max_candidates,
        decode_kernels=args.decode_kernels,
        sample_kernel=args.sample_kernel,
        skinny_matmul=None if args.skinny_matmul == "auto" else args.skinny_matmul == "on",
        prefill_buckets=tuple(int(x) for x in args.prefill_buckets.split(",") if x),
        prefill_rows=(1,),
        weight_dtype=args.weight_dtype,
    )
    runner = ModelRunner(bundle, cfg)
    fill_slots(runner, args.position)
    runner.capture_graphs()
    fill_slots(runner, args.position)
    return runner


def _print_tables(rows: list[dict[str, Any]], prefill: dict[str, Any]) -> None:
    """The per-bucket table, and the top kernels of the smallest and largest buckets and of prefill."""
    print(
        "\n| bucket | step ms | talker ms | c0 head+sample ms | predictor ms | kernels/step | kernel ms/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["profile"]
        print(
            f"| {r['bucket']} | {r['step_ms']:.2f} | {r['talker_ms']:.2f} | {r['c0_head_sample_ms']:.2f} | "
            f"{r['predictor_ms']:.2f} | {p['kernels_per_step']:.0f} | {p['kernel_us_per_step'] / 1e3:.2f} |"
        )
    for r in rows[:1] + rows[-1:]:
        print(f"\ntop kernels at bucket {r['bucket']}:")
        for k in r["profile"]["top"][:15]:
            print(f"  {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['name']}")
    print("\ntop prefill kernels:")
    for k in prefill["profile"]["top"][:12]:
        print(f"  {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['name']}")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("talker_profile needs a CUDA GPU")
    buckets = [int(x) for x in args.buckets.split(",")]
    runner = _runner(args, buckets)
    rows = []
    for b in buckets:
        n, ctx = runner.bucket(b, args.position + 1)
        rows.append(bench_bucket(runner, n, ctx, args))
        if args.out:
            Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, indent=2))
    prefill = bench_prefill(runner, args)
    result = {
        "git": git_revision(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "weights": "dummy (seeded random, bf16)",
        "position": args.position,
        "talker_attention": runner.talker_attention,
        "fused_decode": runner.fused_decode,
        "max_candidates": args.max_candidates,
        "sample_kernel": runner._sampling_kernels is not None,
        "skinny_matmul": runner._linear is not torch.nn.functional.linear,
        "weight_dtype": args.weight_dtype,
        "fused_qkv_attention": runner.fused_qkv,
        "prefill_packed": runner.prefill_packed,
        "rows": rows,
        "prefill": prefill,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    _print_tables(rows, prefill)


if __name__ == "__main__":
    main()
