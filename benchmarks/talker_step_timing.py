"""The timings of `benchmarks.talker_step`: a frame step per batch (graph replay, step wall, eager)
beside its bandwidth and compute floor, prefill into slots, the whole GraphEngine, and their table."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.talker_step_agreement import graph_eager_agreement
from benchmarks.talker_step_numerics import DTYPES, tf32_label, tf32_state
from benchmarks.timing import median_event_s, median_wall_s
from qtts.engine.model_runner import I_POS, ModelRunner, RunnerConfig
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import load_talker_bundle

HBM_BYTES_PER_S = 4.25e12
BF16_FLOPS_PER_S = 690e12
FP32_FLOPS_PER_S = 67e12  # H200 float32 without TF32 (CUDA cores)
# Plain-PyTorch one-graph whole-frame baseline on an H200 (1.7B), and the targets of issue #27
# (bf16), in ms.
BASELINE_1P7B = {1: 8.2, 64: 10.4, 256: 17.4, 512: 27.7, 1024: 48.2}
TARGET_1P7B = {1: 3.0, 256: 6.0, 512: 9.0, 1024: 16.0}


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


def time_batch(runner: ModelRunner, name: str, args: argparse.Namespace, b: int) -> dict[str, Any]:
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
        dtype, tf32 = r.get("dtype", "bfloat16"), tf32_label(r["tf32"]) if "tf32" in r else ""
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
