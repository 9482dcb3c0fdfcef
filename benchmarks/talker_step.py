"""GPU benchmark of the talker engine's frame step (`qtts.engine`) on full-size dummy models.

Builds the full-size talker + code predictor from `configs/<model>` with seeded random bf16
weights (`--load-format dummy`: the same compute as real weights), fills every KV slot with a
stream at position `--position` (a 300-token prompt by default), and measures per batch bucket:

- graph: median time of the captured frame step (talker decode + 15-step predictor + sampling of
  16 codebooks + next-input sum), CUDA events around `graph.replay()`;
- step: wall time of `ModelRunner.decode` (mask upload, replay, codes download, sync);
- eager: the same frame step without graphs (a few buckets only; launch bound);
- prefill of one `--prompt-len`-token prompt (and a batch of 8) into a slot;
- the floor: max(weights + KV bytes / 4.25 TB/s, FLOPs / 690 TFLOP/s) at the real context.

    python -m benchmarks.talker_step --out run/talker_step.json
    python -m benchmarks.talker_step --quick --models qwen3-tts-12hz-1.7b-base
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

from benchmarks.revision import git_revision
from benchmarks.timing import median_event_s, median_wall_s
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
from qtts.engine.scheduler import PrefillChunk
from qtts.engine.sequence import Sequence
from qtts.model import load_talker_bundle

REPO_ROOT = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 4.25e12
BF16_FLOPS_PER_S = 690e12
# Plain-PyTorch one-graph whole-frame baseline on an H200 (1.7B), and the targets, in ms.
BASELINE_1P7B = {1: 8.2, 64: 10.4, 256: 17.4, 512: 27.7, 1024: 48.2}
TARGET_1P7B = {1: 5.0, 256: 14.0, 512: 22.0, 1024: 40.0}




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
    elem = 2
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
    fl = flops / BF16_FLOPS_PER_S * 1e3
    return {"bandwidth_ms": bw, "compute_ms": fl, "floor_ms": max(bw, fl), "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes}


def fill_slots(runner: ModelRunner, position: int) -> None:
    """Every slot holds a sampled stream at `position` (default sampling settings)."""
    s = runner.state_i
    s[:, I_POS] = position
    s[:, I_SEED] = torch.arange(runner.num_slots, device=s.device)
    s[:, I_TOPK] = 50
    s[:, I_PTOPK] = 50
    s[:, I_GREEDY] = 0
    s[:, I_MINF] = 2
    runner.state_f[:, 0] = 0.9  # temperature
    runner.state_f[:, 1] = 1.0  # top_p
    runner.state_f[:, 2] = 1.05  # repetition penalty
    runner.state_f[:, 3] = 0.9
    runner.state_f[:, 4] = 1.0
    runner.next_embed.normal_(0, 0.02)
    runner.trailing.normal_(0, 0.02)
    runner.k_cache.normal_(0, 1.0)
    runner.v_cache.normal_(0, 1.0)


def bench_model(name: str, args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """`variant` is ATTENTION/MODE: mode plain (module calls), fast (fused weights and norms),
    compile (fast + torch.compile of the per-layer work and the sampler), or compile-nocarry
    (compile, with the predictor writing its per-frame KV cache instead of carrying it)."""
    attention, _, mode = variant.partition("/")
    mode = mode or "compile"
    t0 = time.perf_counter()
    bundle = load_talker_bundle(name, device="cuda", dtype=torch.bfloat16, load_format="dummy")
    load_s = time.perf_counter() - t0
    batches = [b for b in args.batches if b <= args.max_batch]
    ctx_bucket = args.context_bucket
    cfg = RunnerConfig(
        max_len=ctx_bucket, max_batch=max(batches), num_slots=max(batches), max_trailing=64,
        batch_buckets=tuple(b for b in DEFAULT_BATCH_BUCKETS if b <= max(batches)), context_buckets=(ctx_bucket,),
        talker_attention=attention,
        max_candidates=args.max_candidates, fast_path=mode != "plain", compile_layers=mode.startswith("compile"),
        predictor_carry_kv=mode != "compile-nocarry",
        prefill_buckets=tuple(args.prefill_buckets),
        prefill_rows=tuple(args.prefill_rows), decode_kernels=args.decode_kernels, sample_kernel=args.sample_kernel,
        skinny_matmul=None if args.skinny_matmul == "auto" else args.skinny_matmul == "on",
    )
    runner = ModelRunner(bundle, cfg)
    fill_slots(runner, args.position)
    t0 = time.perf_counter()
    runner.capture_graphs()
    capture_s = time.perf_counter() - t0
    rows = []
    for b in batches:
        n, ctx = runner.bucket(b, args.position + 1)
        runner.active[:n] = False
        runner.active[:b] = True
        graph = runner.graphs[(n, ctx)]
        # Positions advance with every replay; keep them in range by resetting between runs.
        runner.state_i[:, I_POS] = args.position
        g_ms = _event_median(graph.replay, args.iters)
        runner.state_i[:, I_POS] = args.position
        step_ms = _wall_median(lambda b=b: runner.decode(b, range(b), args.position + 1), args.iters)
        eager_ms = None
        if b in args.eager_batches:
            runner.state_i[:, I_POS] = args.position
            eager_ms = _event_median(lambda n=n, ctx=ctx: runner._frame_step(n, ctx), max(3, args.iters // 10), 1)
        runner.state_i[:, I_POS] = args.position
        same = graph_matches_eager(runner, n, ctx)
        row = {"batch": b, "bucket": n, "context_bucket": ctx, "graph_ms": g_ms, "step_wall_ms": step_ms,
               "eager_ms": eager_ms, "graph_eq_eager": same, **floor_ms(runner, b, args.position)}
        if "1.7b" in name:
            row["baseline_ms"] = BASELINE_1P7B.get(b)
            row["target_ms"] = TARGET_1P7B.get(b)
        rows.append(row)
        _write_partial(args, {"model": name, "talker_attention": variant, "position": args.position, "rows": rows})
        print(f"{name} [{variant}] B={b:5d}: graph {g_ms:7.2f} ms  step {step_ms:7.2f} ms  "
              f"eager {eager_ms if eager_ms is None else round(eager_ms, 2)}  floor {row['floor_ms']:6.2f} ms  "
              f"graph==eager {same:.4f}",
              flush=True)
    prefill = bench_prefill(runner, bundle, args)
    out = {"model": name, "talker_attention": variant, "fused_decode": runner.fused_decode, "sample_kernel": runner._tsample is not None,
           "skinny_matmul": runner._lin is not torch.nn.functional.linear, "load_s": load_s, "capture_s": capture_s,
           "num_graphs": len(runner.graphs), "position": args.position, "rows": rows, "prefill": prefill}
    runner = bundle = None  # free the KV cache and weights before the next model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _write_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Rows measured so far, so that a run cut by a time limit still leaves them behind."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"partial": True, "git": git_revision(), "results": [result]}, indent=2))


def graph_matches_eager(runner: ModelRunner, n: int, ctx: int) -> float:
    """Fraction of codes equal between one eager frame step and one graph replay from the same
    state (greedy rows), a check that the captured graph computes the eager step."""
    runner.state_i[:, I_GREEDY] = 1
    runner.state_i[:, I_PGREEDY] = 1
    saved = [t.clone() for t in (runner.state_i, runner.state_f, runner.next_embed, runner.seen)]
    runner._frame_step(n, ctx)
    eager = runner.codes_out[:n].clone()
    for t, s in zip((runner.state_i, runner.state_f, runner.next_embed, runner.seen), saved, strict=True):
        t.copy_(s)
    runner.graphs[(n, ctx)].replay()
    torch.cuda.synchronize()
    same = (runner.codes_out[:n] == eager).float().mean().item()
    for t, s in zip((runner.state_i, runner.state_f, runner.next_embed, runner.seen), saved, strict=True):
        t.copy_(s)
    runner.state_i[:, I_GREEDY] = 0
    runner.state_i[:, I_PGREEDY] = 0
    return same


def bench_prefill(runner: ModelRunner, bundle, args: argparse.Namespace) -> dict[str, float]:
    """Prefill of one `--prompt-len` prompt (and of 8) into slots: eager ragged batch, and through
    the captured prefill graphs when there are any (with the KV of both paths compared)."""
    h = runner.hidden
    res: dict[str, float] = {}
    graphed = runner.prefill_buckets
    for count in (1, 8):
        seqs = []
        for i in range(count):
            prompt = type("P", (), {})()
            prompt.embeds = torch.randn(args.prompt_len, h, device="cuda", dtype=runner.dtype) * 0.02
            seq = Sequence(f"p{i}", prompt, None, seed=i, max_frames=1, cap_reason="length")
            seq.slot = i
            seqs.append(seq)
        chunks = [PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs]
        runner.prefill_buckets = ()
        res[f"prefill_{count}x{args.prompt_len}_ms"] = _wall_median(lambda c=chunks: runner.prefill(c), 10)
        if graphed:
            n = seqs[0].num_prefill_positions
            want = runner.k_cache[:, :count, :, :n].float().clone()
            runner.prefill_buckets = graphed
            res[f"prefill_graph_{count}x{args.prompt_len}_ms"] = _wall_median(lambda c=chunks: runner.prefill(c), 10)
            got = runner.k_cache[:, :count, :, :n].float()
            res[f"prefill_graph_{count}_kv_max_abs_diff"] = (got - want).abs().max().item()
        runner.prefill_buckets = graphed
    return res


def bench_engine(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The whole GraphEngine on the GPU: `--engine-streams` voice-clone requests (x-vector prompts)
    joining in waves, greedy, `--engine-frames` frames each; wall time of every `step()`."""
    from qtts.engine import EngineConfig, GraphEngine
    from qtts.model import SamplingParams, SynthesisSpec, VoicePrompt

    bundle = load_talker_bundle(name, device="cuda", dtype=torch.bfloat16, load_format="dummy")
    streams = args.engine_streams
    cfg = EngineConfig(runner=RunnerConfig(max_len=1024, max_batch=streams, num_slots=streams, max_trailing=256))
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
    res = {"model": name, "streams": streams, "frames": frames, "finished": finished, "steps": len(step_ms),
           "start_s": start_s, "step_ms_median": statistics.median(step_ms), "step_ms_max": max(step_ms),
           "prompt_len": int(prompts[0].embeds.shape[0])}
    print(f"engine {name}: {res}", flush=True)
    return res


def print_table(results: list[dict[str, Any]]) -> None:
    print()
    print("| model | variant | batch | graph ms | step wall ms | eager ms | floor ms | baseline ms | target ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for row in r["rows"]:
            eager = "" if row["eager_ms"] is None else f"{row['eager_ms']:.2f}"
            base = row.get("baseline_ms") or ""
            tgt = row.get("target_ms") or ""
            print(f"| {r['model']} | {r['talker_attention']} | {row['batch']} | {row['graph_ms']:.2f} | "
                  f"{row['step_wall_ms']:.2f} | {eager} | {row['floor_ms']:.2f} | {base} | {tgt} |")
        print(f"| {r['model']} | prefill | " + ", ".join(f"{k} {v:.2f}" for k, v in r["prefill"].items()) + " |||||||")


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = ["--batches", ",".join(map(str, args.batches)), "--eager-batches", ",".join(map(str, sorted(args.eager_batches))),
           "--max-batch", str(args.max_batch), "--position", str(args.position), "--context-bucket",
           str(args.context_bucket), "--prompt-len", str(args.prompt_len), "--iters", str(args.iters)]
    if args.max_candidates:
        out += ["--max-candidates", str(args.max_candidates)]
    out += ["--decode-kernels", args.decode_kernels, "--sample-kernel", args.sample_kernel, "--skinny-matmul",
            args.skinny_matmul]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-tts-12hz-1.7b-base,qwen3-tts-12hz-0.6b-base")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--eager-batches", default="1,64,256")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--position", type=int, default=300, help="cached positions per stream")
    ap.add_argument("--context-bucket", type=int, default=384, help="attention span of the captured graphs")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--variants", default="matmul/compile",
                    help="comma-separated ATTENTION/MODE (attention: sdpa, sdpa_grouped, matmul; "
                    "mode: plain, fast, compile, compile-nocarry)")
    ap.add_argument("--prefill-buckets", default="64,128,256,512",
                    help="widths of the captured prefill graphs, comma separated ('' : eager prefill only)")
    ap.add_argument("--prefill-rows", default="1,8", help="row buckets of the captured prefill graphs")
    ap.add_argument("--max-candidates", type=int, default=None, help="sampling candidates per row (None: full sort)")
    ap.add_argument("--decode-kernels", default="auto", help="auto, triton or torch (RunnerConfig.decode_kernels)")
    ap.add_argument("--sample-kernel", default="auto", help="auto, triton or torch (RunnerConfig.sample_kernel)")
    ap.add_argument("--skinny-matmul", default="auto", choices=("auto", "on", "off"),
                    help="few-row matmuls on the Triton skinny kernel (RunnerConfig.skinny_matmul)")
    ap.add_argument("--quick", action="store_true", help="batches 1,64,256,1024 and fewer iterations")
    ap.add_argument("--engine", action="store_true", help="also run the whole GraphEngine (waves of joins) "
                    "on the first model")
    ap.add_argument("--engine-streams", type=int, default=64)
    ap.add_argument("--engine-frames", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("talker_step needs a CUDA GPU")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill_buckets = [int(x) for x in args.prefill_buckets.split(",") if x]
    args.prefill_rows = [int(x) for x in args.prefill_rows.split(",") if x]
    args.eager_batches = {int(x) for x in args.eager_batches.split(",") if x and x != "none"}
    variants = args.variants.split(",")
    if args.quick and len(args.batches) == 11:
        args.batches = [1, 64, 256, 1024]
        args.iters = min(args.iters, 20)
    if args.position + 1 > args.context_bucket:
        raise SystemExit("--position must be below --context-bucket")
    runs = [(m, v) for m in args.models.split(",") for v in variants]
    if len(runs) == 1:
        results = [bench_model(runs[0][0], args, runs[0][1])]
    else:
        # One process per run: each sizes its KV cache from the whole GPU.
        results = []
        for model, variant in runs:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [sys.executable, "-m", "benchmarks.talker_step", "--models", model, "--variants", variant,
                       "--out", tmp.name, *_passthrough(args)]
                proc = subprocess.run(cmd, cwd=REPO_ROOT)
                if proc.returncode != 0:
                    print(f"{model} [{variant}] failed with exit code {proc.returncode}", flush=True)
                    continue
                results += json.loads(Path(tmp.name).read_text())["results"]
    print_table(results)
    engine_results = [bench_engine(args.models.split(",")[0], args)] if args.engine else []
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "git": git_revision(),
        "host": platform.node(),
        "weights": "dummy (seeded random, bf16)",
        "frames": "steady-state frame step, every stream at the same position",
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results, "engine": engine_results}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
