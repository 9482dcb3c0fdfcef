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
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.revision import git_revision
from benchmarks.runner_variants import serving_attention, variant_runner
from benchmarks.timing import median_event_s, median_wall_s
from qtts.engine import fp8
from qtts.engine.model_runner import (
    DEFAULT_BATCH_BUCKETS,
    I_GREEDY,
    I_MINF,
    I_PGREEDY,
    I_POS,
    I_PTOPK,
    I_SEED,
    I_TOPK,
    ModelRunner,
    RunnerConfig,
)
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import load_talker_bundle

REPO_ROOT = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 4.25e12
BF16_FLOPS_PER_S = 690e12
FP32_FLOPS_PER_S = 67e12  # H200 float32 without TF32 (CUDA cores)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Plain-PyTorch one-graph whole-frame baseline on an H200 (1.7B), and the targets of issue #27
# (bf16), in ms.
BASELINE_1P7B = {1: 8.2, 64: 10.4, 256: 17.4, 512: 27.7, 1024: 48.2}
TARGET_1P7B = {1: 3.0, 256: 6.0, 512: 9.0, 1024: 16.0}


def set_precision(dtype: str) -> dict[str, Any]:
    """float32: TF32 off everywhere (call before any CUDA work). Returns the TF32 state."""
    if dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    return tf32_state()


def tf32_state() -> dict[str, Any]:
    state = {
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    fp32 = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # the newer API, where it exists
    if fp32 is not None:
        state["matmul_fp32_precision"] = str(fp32)
    return state


def _tf32_label(state: dict[str, Any]) -> str:
    on = (
        state["matmul_allow_tf32"]
        or state["cudnn_allow_tf32"]
        or state["float32_matmul_precision"] != "highest"
    )
    return "on" if on else "off"


def _event_median(fn, iters: int, warmup: int = 3) -> float:
    return median_event_s(fn, iters, warmup) * 1e3


def _wall_median(fn, iters: int, warmup: int = 3) -> float:
    return median_wall_s(fn, iters, warmup) * 1e3


def _linear_params(module: torch.nn.Module, skip: tuple[str, ...]) -> int:
    """Parameters read by a decode step: every weight except the embedding tables."""
    return sum(p.numel() for n, p in module.named_parameters() if not any(s in n for s in skip))


def floor_ms(runner: ModelRunner, batch: int, context: int) -> dict[str, float]:
    """Bandwidth and compute floors of one frame step at `context` cached positions per row."""
    t, p = runner.tdec, runner.pdec
    elem = torch.finfo(runner.dtype).bits // 8
    talker_params = _linear_params(runner.talker, ("embedding", "text_projection"))
    pred_params = _linear_params(runner.predictor, ("embedding",))
    head_params = sum(h.weight.numel() for h in runner.predictor.lm_head)
    pred_body = pred_params - head_params
    weight_bytes = (talker_params + pred_params) * elem
    kv_bytes = batch * context * runner.bytes_per_position()
    pred_kv = batch * 2 * p.num_layers * p.num_kv_heads * p.head_dim * elem * 16 * 8  # small, ~16 positions
    bytes_total = weight_bytes + kv_bytes + pred_kv
    # Matmul FLOPs: talker one token; predictor 16 tokens through its layers, one head per step.
    flops = 2 * batch * talker_params + 2 * batch * (16 * pred_body + head_params)
    flops += 4 * batch * t.num_layers * t.num_heads * t.head_dim * context
    flops += 4 * batch * p.num_layers * p.num_heads * p.head_dim * 16 * 8
    bw = bytes_total / HBM_BYTES_PER_S * 1e3
    fl = flops / (FP32_FLOPS_PER_S if runner.dtype == torch.float32 else BF16_FLOPS_PER_S) * 1e3
    return {
        "bandwidth_ms": bw,
        "compute_ms": fl,
        "floor_ms": max(bw, fl),
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
    }


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
    runner.k_cache.normal_(0, 1.0)
    runner.v_cache.normal_(0, 1.0)


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
        f"{name} [{variant}] dtype {args.dtype}, tf32 {_tf32_label(tf32)} {tf32}; kernels: {kernels['kernels']}",
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
    """Per batch, its timed row (`_time_batch`), written out and told as it comes."""
    rows = []
    for b in batches:
        row = _time_batch(runner, name, args, b)
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


def _time_batch(runner: ModelRunner, name: str, args: argparse.Namespace, b: int) -> dict[str, Any]:
    """Batch `b`'s row: graph replay, step wall and (--eager-batches) eager times, the
    graph-vs-eager check and the memory floor (with the 1.7B baseline and target)."""
    n, ctx = runner.bucket(b, args.position + 1)
    runner.active[:n] = False
    runner.active[:b] = True
    graph = runner.graphs[(n, ctx)]
    # Positions advance with every replay; keep them in range by resetting between runs.
    runner.slot_ints[:, I_POS] = args.position
    g_ms = _event_median(graph.replay, args.iters)
    runner.slot_ints[:, I_POS] = args.position
    step_ms = _wall_median(lambda b=b: runner.decode(b, range(b), args.position + 1), args.iters)
    eager_ms = None
    if b in args.eager_batches:
        runner.slot_ints[:, I_POS] = args.position
        eager_ms = _event_median(lambda n=n, ctx=ctx: runner._frame_step(n, ctx), max(3, args.iters // 10), 1)
    runner.slot_ints[:, I_POS] = args.position
    agree = graph_eager_agreement(runner, n, ctx, rows=b, frames=args.agreement_frames)
    same = agree["codes"]
    row = {
        "batch": b,
        "bucket": n,
        "context_bucket": ctx,
        "graph_ms": g_ms,
        "step_wall_ms": step_ms,
        "eager_ms": eager_ms,
        "graph_eq_eager": same,
        "graph_eq_eager_frames": agree["frames"],
        **floor_ms(runner, b, args.position),
    }
    if "1.7b" in name:
        row["baseline_ms"] = BASELINE_1P7B.get(b)
        row["target_ms"] = TARGET_1P7B.get(b)
    return row


def _write_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Rows measured so far, so that a run cut by a time limit still leaves them behind."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"partial": True, "git": git_revision(), "results": [result]}, indent=2)
        )


def bucket_map(batches: list[int]) -> dict[int, int]:
    """The batch bucket each of `batches` runs in, as ModelRunner.bucket maps it when its slots are
    max(batches) and its buckets DEFAULT_BATCH_BUCKETS (those below the slot count, and the count)."""
    slots = max(batches)
    buckets = sorted({b for b in DEFAULT_BATCH_BUCKETS if b < slots} | {slots})
    return {b: next(n for n in buckets if n >= b) for b in batches}


def kernel_choices(runner: ModelRunner) -> dict[str, Any]:
    """Which kernels the frame step runs (RunnerConfig.decode_kernels / sample_kernel / skinny_matmul
    as resolved). Every Triton kernel accepts float32 (IEEE dots there, no TF32), so no choice
    depends on the dtype."""
    fused, sample, skinny = (
        runner.fused_decode,
        runner._sampling_kernels is not None,
        runner._linear is not F.linear,
    )
    note = (
        f"decode {'triton' if fused else 'torch'}, sampling {'triton' if sample else 'torch'}, "
        f"skinny matmul {'on' if skinny else 'off'}"
    )
    if runner.dtype == torch.float32 and (fused or sample):
        note += " (the Triton kernels take float32 as is, with IEEE float32 dots)"
    return {"fused_decode": fused, "sample_kernel": sample, "skinny_matmul": skinny, "kernels": note}


def graph_eager_agreement(
    runner: ModelRunner, n: int, ctx: int, rows: int | None = None, frames: int = 1
) -> dict[str, float]:
    """Greedy codes of one graph replay against one eager frame step from the same state, for
    `frames` consecutive frames of rows [0, rows) (default: the whole bucket of n rows; the caller
    marks them active). Each frame starts both paths from the same state (state, sampling
    parameters, next input, penalty mask; the KV positions they write are rewritten by the next
    path before it reads them), then continues from the graph's result. Returns the share of
    codes equal ("codes") and of row-frames whose codes are all equal ("frames"). Every slot's
    state is put back afterwards."""
    rows = n if rows is None else rows
    graph = runner.graphs[(n, ctx)]
    state = (runner.slot_ints, runner.slot_floats, runner.next_embed, runner.seen)
    same_codes = same_frames = 0
    with torch.inference_mode():
        saved = [t.clone() for t in state]
        runner.slot_ints[:, I_GREEDY] = 1
        runner.slot_ints[:, I_PGREEDY] = 1
        for _ in range(frames):
            before = [t.clone() for t in state]
            runner._frame_step(n, ctx)
            eager = runner.codes_out[:rows].clone()
            for t, s in zip(state, before, strict=True):
                t.copy_(s)
            graph.replay()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            same = runner.codes_out[:rows] == eager  # [rows, codebooks]
            same_codes += int(same.sum().item())
            same_frames += int(same.all(dim=1).sum().item())
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
    total = frames * rows
    return {"codes": same_codes / (total * runner.num_codebooks), "frames": same_frames / total}


def graph_matches_eager(
    runner: ModelRunner, n: int, ctx: int, rows: int | None = None, frames: int = 1
) -> float:
    """Share of greedy codes equal between graph replays and eager steps (see graph_eager_agreement)."""
    return graph_eager_agreement(runner, n, ctx, rows, frames)["codes"]


def bench_prefill(runner: ModelRunner, bundle, args: argparse.Namespace) -> dict[str, float]:
    """Prefill of one `--prompt-len` prompt (and of 8) into slots: eager, and through the captured
    prefill graphs when there are any (with the KV of both paths compared). With the packed
    prefill (the default) both are packed calls; benchmarks/prefill_cost.py compares it with the
    per-row prefill."""
    h = runner.hidden
    res: dict[str, float] = {}
    packed = runner.prefill_packed
    graphed = runner.packed_graphs if packed else runner.prefill_buckets

    def use_graphs(on: bool) -> None:
        if packed:
            runner.packed_graphs = graphed if on else {}
        else:
            runner.prefill_buckets = graphed if on else ()

    for count in (1, 8):
        seqs = []
        for i in range(count):
            prompt = type("P", (), {})()
            prompt.embeds = torch.randn(args.prompt_len, h, device="cuda", dtype=runner.dtype) * 0.02
            seq = Sequence(f"p{i}", prompt, None, seed=i, max_frames=1, cap_reason="length")
            seq.slot = i
            seqs.append(seq)
        chunks = [PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs]
        use_graphs(False)
        res[f"prefill_{count}x{args.prompt_len}_ms"] = _wall_median(lambda c=chunks: runner.prefill(c), 10)
        if graphed:
            n = seqs[0].num_prefill_positions
            want = runner.k_cache[:, :count, :, :n].float().clone()
            use_graphs(True)
            res[f"prefill_graph_{count}x{args.prompt_len}_ms"] = _wall_median(
                lambda c=chunks: runner.prefill(c), 10
            )
            got = runner.k_cache[:, :count, :, :n].float()
            res[f"prefill_graph_{count}_kv_max_abs_diff"] = (got - want).abs().max().item()
        use_graphs(True)
    return res


def bench_engine(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The whole GraphEngine on the GPU: `--engine-streams` voice-clone requests (x-vector prompts)
    joining in waves, greedy, `--engine-frames` frames each; wall time of every `step()`."""
    from qtts.engine import GraphEngine, GraphEngineConfig
    from qtts.model import SamplingParams, SynthesisSpec, VoicePrompt

    bundle = load_talker_bundle(name, device="cuda", dtype=DTYPES[args.dtype], load_format="dummy")
    streams = args.engine_streams
    cfg = GraphEngineConfig(
        runner=RunnerConfig(max_len=1024, max_batch=streams, num_slots=streams, max_trailing=256)
    )
    t0 = time.perf_counter()
    eng = GraphEngine(bundle, config=cfg)
    start_s = time.perf_counter() - t0
    h = bundle.talker.hidden_size
    text = "The quick brown fox jumps over the lazy dog near the quiet river bank today."
    prompts = []
    for _ in range(streams):
        voice = VoicePrompt(x_vector=torch.randn(h) * 0.02, ref_codes=None, ref_text=None, x_vector_only=True)
        prompts.append(bundle.build_prompt(SynthesisSpec(text=text, task="voice_clone", voice_prompt=voice)))
    greedy = SamplingParams(greedy=True)
    step_ms, frames, finished = [], 0, 0
    waves = 4
    i = 0
    while i < streams or eng.has_work:
        if i < streams:  # a wave joins every few steps while others run
            for _ in range(max(1, streams // waves)):
                if i < streams:
                    eng.add(f"s{i}", prompts[i], greedy, args.engine_frames)
                    i += 1
        t = time.perf_counter()
        outs = eng.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        frames += sum(o.codes is not None for o in outs)
        finished += sum(o.finished for o in outs)
    res = {
        "model": name,
        "streams": streams,
        "frames": frames,
        "finished": finished,
        "steps": len(step_ms),
        "start_s": start_s,
        "step_ms_median": statistics.median(step_ms),
        "step_ms_max": max(step_ms),
        "prompt_len": int(prompts[0].embeds.shape[0]),
        "tokenizer": bundle.tokenizer_name,
        "dtype": args.dtype,
        "tf32": tf32_state(),
    }
    print(f"engine {name}: {res}", flush=True)
    return res


def print_table(results: list[dict[str, Any]]) -> None:
    print()
    print(
        "| model | variant | dtype | tf32 | batch | graph ms | step wall ms | eager ms | floor ms | graph==eager "
        "(codes / frames) | baseline ms | target ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        dtype, tf32 = r.get("dtype", "bfloat16"), _tf32_label(r["tf32"]) if "tf32" in r else ""
        for row in r["rows"]:
            eager = "" if row["eager_ms"] is None else f"{row['eager_ms']:.2f}"
            base = row.get("baseline_ms") or ""
            tgt = row.get("target_ms") or ""
            eq = f"{row['graph_eq_eager']:.4f} / {row.get('graph_eq_eager_frames', float('nan')):.4f}"
            print(
                f"| {r['model']} | {r['talker_attention']} | {dtype} | {tf32} | {row['batch']} | "
                f"{row['graph_ms']:.2f} | {row['step_wall_ms']:.2f} | {eager} | {row['floor_ms']:.2f} | {eq} | "
                f"{base} | {tgt} |"
            )
        print(
            f"| {r['model']} | prefill | "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["prefill"].items())
            + " ||||||||||"
        )


def agreement_verdict(results: list[dict[str, Any]], min_agreement: float) -> dict[str, Any]:
    """PASS when every bucket of every run has at least `min_agreement` of its row-frames equal."""
    below = [
        {
            "model": r["model"],
            "variant": r["talker_attention"],
            "batch": row["batch"],
            "bucket": row["bucket"],
            "graph_eq_eager_frames": row["graph_eq_eager_frames"],
        }
        for r in results
        for row in r["rows"]
        if row["graph_eq_eager_frames"] < min_agreement
    ]
    rows = [row for r in results for row in r["rows"]]
    worst = min(rows, key=lambda row: row["graph_eq_eager_frames"]) if rows else None
    return {
        "pass": bool(rows) and not below,
        "min_agreement": min_agreement,
        "below": below,
        "worst": None
        if worst is None
        else {k: worst[k] for k in ("batch", "bucket", "graph_eq_eager_frames")},
    }


def print_agreement(results: list[dict[str, Any]], verdict: dict[str, Any]) -> None:
    print()
    print(
        "| model | variant | dtype | tf32 | kernels | batch | bucket | graph_eq_eager (codes) | frames all equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["rows"]:
            print(
                f"| {r['model']} | {r['talker_attention']} | {r['dtype']} | {_tf32_label(r['tf32'])} | "
                f"{r['kernels']} | {row['batch']} | {row['bucket']} | {row['graph_eq_eager']:.4f} | "
                f"{row['graph_eq_eager_frames']:.4f} |"
            )
    frames = ", ".join(sorted({str(r["agreement_frames"]) for r in results})) or "-"
    if verdict["pass"]:
        w = verdict["worst"]
        print(
            f"PASS: every bucket has >= {verdict['min_agreement']} of its row-frames ({frames} frames per row) "
            f"with graph codes equal to eager (lowest {w['graph_eq_eager_frames']:.4f} at batch {w['batch']}, "
            f"bucket {w['bucket']})",
            flush=True,
        )
    elif not results:
        print("FAIL: no run finished", flush=True)
    else:
        worst = ", ".join(
            f"{b['model']} [{b['variant']}] batch {b['batch']} (bucket {b['bucket']}) "
            f"{b['graph_eq_eager_frames']:.4f}"
            for b in verdict["below"]
        )
        print(f"FAIL: below {verdict['min_agreement']} of row-frames equal: {worst}", flush=True)


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
