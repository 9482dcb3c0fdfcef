"""GPU benchmark of the talker engine's frame step (`qtts.engine`) on full-size dummy models.

Builds the full-size talker + code predictor from `configs/<model>` with seeded random bf16
weights (`--load-format dummy`: the same compute as real weights), fills every KV slot with a
stream at position `--position` (a 300-token prompt by default), and measures per batch bucket:

- graph: median time of the captured frame step (talker decode + 15-step predictor + sampling of
  16 codebooks + next-input sum), CUDA events around `graph.replay()`;
- step: wall time of `ModelRunner.decode` (mask upload, replay, codes download, sync);
- eager: the same frame step without graphs (a few buckets only; launch bound);
- prefill of one `--prompt-len`-token prompt (and a batch of 8) into a slot;
- the floor: max(weights + KV bytes / 4.25 TB/s, FLOPs / 690 TFLOP/s) at the real context;
- graph_eq_eager: the share of greedy codes equal between a graph replay and an eager step from the
  same state, over `--agreement-frames` frames of every active row (graph_eq_eager_frames: the
  share of row-frames whose 16 codes are all equal).

`--dtype float32` builds the model in float32 with TF32 off everywhere (cuBLAS, cuDNN, matmul
precision "highest"; the Triton decode kernels take IEEE float32 dots for float32 inputs), so graph
and eager differ only by summation order: greedy codes should then agree on (almost) every frame,
and bf16 disagreement is near-tie flips. `--agreement-only` runs just that check per batch bucket
(capture, no timing loops, no prefill graphs) and ends with PASS/FAIL against `--min-agreement`
(exit status 1 on FAIL).

    python -m benchmarks.talker_step --out run/talker_step.json
    python -m benchmarks.talker_step --quick --models qwen3-tts-12hz-1.7b-base
    python -m benchmarks.talker_step --models qwen3-tts-12hz-1.7b-base --dtype float32 --agreement-only

This file runs the variants and writes the results; the measurements live beside it:
`talker_step_timing.py` (frame step, floor, prefill, engine, the table), `talker_step_agreement.py`
(graph vs eager, the verdict) and `talker_step_numerics.py` (dtype, TF32, kernels).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.revision import git_revision
from benchmarks.runner_variants import serving_attention, variant_runner
from benchmarks.talker_step_agreement import (
    agreement_verdict,
    bucket_map,
    graph_eager_agreement,
    print_agreement,
)
from benchmarks.talker_step_numerics import DTYPES, kernel_choices, set_precision, tf32_label, tf32_state
from benchmarks.talker_step_timing import bench_engine, bench_prefill, print_table, time_batch
from qtts.engine import fp8
from qtts.engine.model_runner import (
    DEFAULT_BATCH_BUCKETS,
    I_GREEDY,
    I_MINF,
    I_POS,
    I_PTOPK,
    I_SEED,
    I_TOPK,
    ModelRunner,
    RunnerConfig,
)
from qtts.model import load_talker_bundle

REPO_ROOT = Path(__file__).resolve().parent.parent


def fill_slots(runner: ModelRunner, position: int) -> None:
    """Every slot holds a sampled stream at `position` (default sampling settings)."""
    s = runner.slot_ints
    s[:, I_POS] = position
    s[:, I_SEED] = torch.arange(runner.num_slots, device=s.device)
    s[:, I_TOPK] = 50
    s[:, I_PTOPK] = 50
    s[:, I_GREEDY] = 0
    s[:, I_MINF] = 2
    runner.slot_floats[:, 0] = 0.9  # temperature
    runner.slot_floats[:, 1] = 1.0  # top_p
    runner.slot_floats[:, 2] = 1.05  # repetition penalty
    runner.slot_floats[:, 3] = 0.9
    runner.slot_floats[:, 4] = 1.0
    runner.next_embed.normal_(0, 0.02)
    runner.trailing.normal_(0, 0.02)
    for cache in (runner.k_cache, runner.v_cache):
        for layer in cache:  # layer by layer: an 8-bit cache has no normal_, and is filled through bf16
            layer.copy_(torch.randn(layer.shape, device=layer.device, dtype=torch.bfloat16))


def bench_model(name: str, args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """`variant` is ATTENTION/MODE: mode plain (module calls), fast (fused weights and norms),
    compile (fast + torch.compile of the per-layer work and the sampler), or compile-nocarry
    (compile, with the predictor writing its per-frame KV cache instead of carrying it); attention
    sdpa_grouped and mode compile-nocarry are the measured-out variants of benchmarks/runner_variants.py."""
    attention, _, mode = variant.partition("/")
    mode = mode or "compile"
    t0 = time.perf_counter()
    bundle = load_talker_bundle(name, device="cuda", dtype=DTYPES[args.dtype], load_format="dummy")
    load_s = time.perf_counter() - t0
    batches = [b for b in args.batches if b <= args.max_batch]
    runner = variant_runner(bundle, _runner_config(args, attention, mode, batches), attention, mode)
    kernels = kernel_choices(runner)
    tf32 = tf32_state()
    print(
        f"{name} [{variant}] dtype {args.dtype}, tf32 {tf32_label(tf32)} {tf32}; kernels: {kernels['kernels']}",
        flush=True,
    )
    fill_slots(runner, args.position)
    t0 = time.perf_counter()
    runner.capture_graphs()
    capture_s = time.perf_counter() - t0
    print(f"{name} [{variant}] captured {len(runner.graphs)} graphs in {capture_s:.1f} s", flush=True)
    head = {
        "model": name,
        "talker_attention": variant,
        "dtype": args.dtype,
        "weight_dtype": args.weight_dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        # FP8 linears on the reference path (torch._scaled_mm refused): then its times mean nothing
        "fp8_scaled_mm_failed": list(fp8._SCALED_MM_FAILED),
        "fused_qkv_attention": runner.fused_qkv,
        "prefill_packed": runner.prefill_packed,
        "tf32": tf32,
        **kernels,
        "position": args.position,
        "agreement_frames": args.agreement_frames,
    }
    if args.agreement_only:
        rows, extra = _agreement_rows(runner, name, variant, args, batches, head), {}
    else:
        rows = _timed_rows(runner, name, variant, args, batches, head)
        extra = {"prefill": bench_prefill(runner, bundle, args)}
    out = {
        **head,
        "load_s": load_s,
        "capture_s": capture_s,
        "num_graphs": len(runner.graphs),
        "rows": rows,
        **extra,
        "tokenizer": bundle.tokenizer_name,
    }
    runner = bundle = None  # free the KV cache and weights before the next model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _runner_config(args: argparse.Namespace, attention: str, mode: str, batches: list[int]) -> RunnerConfig:
    """The runner of one variant, its slots and batch buckets sized for `batches` (with
    --agreement-only: only the buckets those land in, and no prefill graphs)."""
    ctx_bucket = args.context_bucket
    buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b <= max(batches))
    if args.agreement_only:  # capture only the buckets that --batches lands in (the runner's own mapping)
        buckets = tuple(sorted(set(bucket_map(batches).values())))
    return RunnerConfig(
        max_len=ctx_bucket,
        max_batch=max(batches),
        num_slots=max(batches),
        max_trailing=64,
        batch_buckets=buckets,
        context_buckets=(ctx_bucket,),
        talker_attention=serving_attention(attention),
        max_candidates=args.max_candidates,
        fast_path=mode != "plain",
        compile_layers=mode.startswith("compile"),
        prefill_buckets=() if args.agreement_only else tuple(args.prefill_buckets),
        prefill_rows=tuple(args.prefill_rows),
        decode_kernels=args.decode_kernels,
        sample_kernel=args.sample_kernel,
        skinny_matmul=None if args.skinny_matmul == "auto" else args.skinny_matmul == "on",
        weight_dtype=args.weight_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def _agreement_rows(
    runner: ModelRunner,
    name: str,
    variant: str,
    args: argparse.Namespace,
    batches: list[int],
    head: dict[str, Any],
) -> list[dict[str, Any]]:
    """--agreement-only: per batch, the graph-vs-eager check alone (no timing)."""
    rows = []
    for b in batches:
        n, ctx = runner.bucket(b, args.position + 1)
        runner.active[:n] = False
        runner.active[:b] = True
        runner.slot_ints[:, I_POS] = args.position
        agree = graph_eager_agreement(runner, n, ctx, rows=b, frames=args.agreement_frames)
        rows.append(
            {
                "batch": b,
                "bucket": n,
                "context_bucket": ctx,
                "graph_eq_eager": agree["codes"],
                "graph_eq_eager_frames": agree["frames"],
            }
        )
        _write_partial(args, {**head, "rows": rows})
        print(
            f"{name} [{variant}] {args.dtype} B={b:5d} bucket={n:5d}: graph_eq_eager {agree['codes']:.4f} "
            f"(frames all equal {agree['frames']:.4f})",
            flush=True,
        )
    return rows


def _timed_rows(
    runner: ModelRunner,
    name: str,
    variant: str,
    args: argparse.Namespace,
    batches: list[int],
    head: dict[str, Any],
) -> list[dict[str, Any]]:
    """Per batch, its timed row (`time_batch`), written out and told as it comes."""
    rows = []
    for b in batches:
        row = time_batch(runner, name, args, b)
        rows.append(row)
        _write_partial(args, {**head, "rows": rows})
        eager_ms = row["eager_ms"]
        print(
            f"{name} [{variant}] B={b:5d}: graph {row['graph_ms']:7.2f} ms  step {row['step_wall_ms']:7.2f} ms  "
            f"eager {eager_ms if eager_ms is None else round(eager_ms, 2)}  floor {row['floor_ms']:6.2f} ms  "
            f"graph==eager {row['graph_eq_eager']:.4f}",
            flush=True,
        )
    return rows


def _write_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Rows measured so far, so that a run cut by a time limit still leaves them behind."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"partial": True, "git": git_revision(), "results": [result]}, indent=2)
        )


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = [
        "--batches",
        ",".join(map(str, args.batches)),
        "--eager-batches",
        ",".join(map(str, sorted(args.eager_batches))),
        "--max-batch",
        str(args.max_batch),
        "--position",
        str(args.position),
        "--context-bucket",
        str(args.context_bucket),
        "--prompt-len",
        str(args.prompt_len),
        "--iters",
        str(args.iters),
    ]
    if args.max_candidates:
        out += ["--max-candidates", str(args.max_candidates)]
    out += [
        "--decode-kernels",
        args.decode_kernels,
        "--sample-kernel",
        args.sample_kernel,
        "--skinny-matmul",
        args.skinny_matmul,
        "--weight-dtype",
        args.weight_dtype,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
        "--dtype",
        args.dtype,
        "--agreement-frames",
        str(args.agreement_frames),
        "--min-agreement",
        str(args.min_agreement),
        "--child",
    ]
    if args.agreement_only:
        out.append("--agreement-only")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the list options parsed (no CUDA needed).

    Long, kept in one piece: a flag table, then the list options and the checks across flags."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-tts-12hz-1.7b-base,qwen3-tts-12hz-0.6b-base")
    ap.add_argument(
        "--batches",
        default="1,2,4,8,16,32,64,128,256,512,1024",
        help="comma-separated batch sizes, or 'all': every batch bucket up to --max-batch",
    )
    ap.add_argument("--eager-batches", default="1,64,256")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--position", type=int, default=300, help="cached positions per stream")
    ap.add_argument("--context-bucket", type=int, default=384, help="attention span of the captured graphs")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--variants",
        default="matmul/compile",
        help="comma-separated ATTENTION/MODE (attention: sdpa, sdpa_grouped, matmul; "
        "mode: plain, fast, compile, compile-nocarry)",
    )
    ap.add_argument(
        "--prefill-buckets",
        default="64,128,256,512",
        help="widths of the captured prefill graphs, comma separated ('' : eager prefill only)",
    )
    ap.add_argument("--prefill-rows", default="1,8", help="row buckets of the captured prefill graphs")
    ap.add_argument(
        "--max-candidates", type=int, default=None, help="sampling candidates per row (None: full sort)"
    )
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
        "--weight-dtype",
        default="model",
        choices=("model", "fp8"),
        help="decoder-layer linear weights: the model dtype, or fp8 (RunnerConfig.weight_dtype)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="model",
        choices=("model", "fp8"),
        help="the talker's KV cache: the model dtype, or fp8 (RunnerConfig.kv_cache_dtype)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=tuple(DTYPES),
        help="model dtype; float32 also turns TF32 off (cuBLAS, cuDNN, matmul precision 'highest')",
    )
    ap.add_argument(
        "--agreement-only",
        action="store_true",
        help="per batch bucket only capture and the graph-vs-eager greedy check (no timing, no "
        "prefill graphs); ends with PASS/FAIL against --min-agreement",
    )
    ap.add_argument(
        "--agreement-frames",
        type=int,
        default=8,
        help="frames per row compared between graph replay and eager step",
    )
    ap.add_argument(
        "--min-agreement",
        type=float,
        default=0.99,
        help="--agreement-only: least share of row-frames with all codes equal, in every bucket",
    )
    ap.add_argument(
        "--child", action="store_true", help=argparse.SUPPRESS
    )  # one run of several: exit 0 on FAIL
    ap.add_argument("--quick", action="store_true", help="batches 1,64,256,1024 and fewer iterations")
    ap.add_argument(
        "--engine",
        action="store_true",
        help="also run the whole GraphEngine (waves of joins) on the first model",
    )
    ap.add_argument("--engine-streams", type=int, default=64)
    ap.add_argument("--engine-frames", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.batches.strip() == "all":
        args.batches = [b for b in DEFAULT_BATCH_BUCKETS if b <= args.max_batch]
    else:
        args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill_buckets = [int(x) for x in args.prefill_buckets.split(",") if x]
    args.prefill_rows = [int(x) for x in args.prefill_rows.split(",") if x]
    args.eager_batches = {int(x) for x in args.eager_batches.split(",") if x and x != "none"}
    if args.quick and len(args.batches) == 11:
        args.batches = [1, 64, 256, 1024]
        args.iters = min(args.iters, 20)
    if not [b for b in args.batches if b <= args.max_batch]:
        ap.error("no batch in --batches is <= --max-batch")
    if args.agreement_frames < 1:
        ap.error("--agreement-frames must be >= 1")
    if args.position + 1 > args.context_bucket:
        ap.error("--position must be below --context-bucket")
    if args.position + args.agreement_frames > args.context_bucket:
        ap.error("--position + --agreement-frames must be <= --context-bucket")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tf32 = set_precision(args.dtype)  # before any CUDA work
    if not torch.cuda.is_available():
        raise SystemExit("talker_step needs a CUDA GPU")
    variants = args.variants.split(",")
    runs = [(m, v) for m in args.models.split(",") for v in variants]
    if len(runs) == 1:
        results = [bench_model(runs[0][0], args, runs[0][1])]
    else:
        # One process per run: each sizes its KV cache from the whole GPU.
        results = []
        for model, variant in runs:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [
                    sys.executable,
                    "-m",
                    "benchmarks.talker_step",
                    "--models",
                    model,
                    "--variants",
                    variant,
                    "--out",
                    tmp.name,
                    *_passthrough(args),
                ]
                proc = subprocess.run(cmd, cwd=REPO_ROOT)
                if proc.returncode != 0:
                    print(f"{model} [{variant}] failed with exit code {proc.returncode}", flush=True)
                    continue
                results += json.loads(Path(tmp.name).read_text())["results"]
    verdict = None
    if args.agreement_only:
        verdict = agreement_verdict(results, args.min_agreement)
        print_agreement(results, verdict)
    else:
        print_table(results)
    engine_results = (
        [bench_engine(args.models.split(",")[0], args)] if args.engine and not args.agreement_only else []
    )
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "git": git_revision(),
        "host": platform.node(),
        "dtype": args.dtype,
        "tf32": tf32,
        "mode": "agreement-only" if args.agreement_only else "timing",
        "weights": f"dummy (seeded random, {args.dtype})",
        "frames": "steady-state frame step, every stream at the same position",
    }
    out = {"meta": meta, "results": results, "engine": engine_results}
    if verdict is not None:
        out["agreement"] = verdict
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    if verdict is not None and not verdict["pass"] and not args.child:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
