"""FP8 fidelity: greedy codes and codebook-0 logits of the FP8 engine against bf16 and float32.

Four engines on the same seeded random weights (`--load-format dummy` draws them in float32; the
bf16 model is their rounding): float32 with TF32 off, bf16, and bf16 with
`RunnerConfig.weight_dtype="fp8"` (decoder-layer linears in float8_e4m3fn, per-channel weight
scales, per-token activation scales), and bf16 with `RunnerConfig.kv_cache_dtype="fp8"` ("kv8":
the talker's KV cache in float8_e4m3fn; on a CPU it needs TRITON_INTERPRET=1 and runs in
float32, as the interpreter does not run the kernels faithfully in bfloat16). For every batch in `--batches` each engine prefills the same
`--prompt-len`-position random prompts (packed prefill, its own precision), then runs `--frames`
greedy frame steps at that batch's bucket (eager: graphs replay the same kernels, which
`talker_step --agreement-only` checks). Per pair of engines and batch:

- frame0_rows_equal: share of rows whose 16 codes are all equal on the first frame (same history);
- frame0_c0_equal: share of rows with the same codebook-0 code on the first frame;
- codes_equal: share of all codes equal over the frames, free running (differences compound);
- logit_rel_err: mean over rows of |l - l_ref| / |l_ref| of the first frame's codebook-0 logits
  (after penalty and masks; suppressed ids left out), and logit_max_abs_err.

bf16 against float32 is the yardstick: the FP8 engine's distance to float32 should be of the same
order, and its distance to bf16 says what switching bf16 to FP8 changes. One linear alone
(`single_linear_rel_err`) shows the rounding step each precision starts from: random weights
amplify it through 28 + 5 layers (bf16's ~0.3% per linear became ~3.7% of the logits on an H200),
so the end-to-end ratio FP8 / bf16 should follow the per-linear ratio. Speed: `talker_step
--weight-dtype fp8`.

    python3 -m benchmarks.fp8_fidelity --out benchmarks/results/fp8_fidelity.json
    python3 -m benchmarks.fp8_fidelity --device cpu --tiny      # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.revision import git_revision
from qtts.engine import fp8
from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import SamplingParams, load_talker_bundle

# name: (model dtype, RunnerConfig.weight_dtype, RunnerConfig.kv_cache_dtype)
ENGINES = {
    "float32": (torch.float32, "model", "model"),
    "bf16": (torch.bfloat16, "model", "model"),
    "fp8": (torch.bfloat16, "fp8", "model"),
    "kv8": (torch.bfloat16, "model", "fp8"),
}
PAIRS = (
    ("fp8", "float32"),
    ("fp8", "bf16"),
    ("kv8", "float32"),
    ("kv8", "bf16"),
    ("bf16", "float32"),
)


def load(args: argparse.Namespace, dtype: torch.dtype, workdir: Path):
    if args.tiny:
        from qtts.tiny_model import build_tiny_snapshot

        snap = build_tiny_snapshot(workdir / "qwen3-tts-tiny-base", "base", seed=0)
        return load_talker_bundle(snap, device=args.device, dtype=dtype, load_format="dummy")
    return load_talker_bundle(args.model, device=args.device, dtype=dtype, load_format="dummy")


def prompts(args: argparse.Namespace, hidden: int) -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(max(args.batches)):
        out.append(
            SimpleNamespace(
                embeds=torch.randn(args.prompt_len, hidden, generator=g) * args.embed_std,
                trailing=torch.randn(4, hidden, generator=g) * args.embed_std,
                pad_embed=torch.randn(hidden, generator=g) * args.embed_std,
            )
        )
    return out


def single_linear_errors(runner: ModelRunner, rows: int = 64) -> dict[str, dict[str, float]]:
    """One linear alone, on the float32 engine's exact weights: relative error of the bf16 and the
    FP8 product against float32 for the first talker and predictor layer's four weights, on
    N(0, 1) activations. How much of the end-to-end logit error is one rounding step, amplified
    by the random network (bf16 and FP8 should be amplified alike; a scale bug would not be)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    out = {}
    for part, weights in (("talker", runner.talker_weights[0]), ("predictor", runner.predictor_weights[0])):
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            w = getattr(weights, name).float()
            x = torch.randn(rows, w.shape[1], generator=g).to(w.device)
            ref = x @ w.t()
            bf16 = (x.bfloat16() @ w.bfloat16().t()).float()
            f8 = fp8.fp8_linear(x.bfloat16(), fp8.quantize_weight(w)).float()
            out[f"{part}.{name}"] = {
                "bf16": ((bf16 - ref).norm() / ref.norm()).item(),
                "fp8": ((f8 - ref).norm() / ref.norm()).item(),
            }
    return out


def run_engine(name: str, args: argparse.Namespace, workdir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per batch: the first frame's codebook-0 logits [b, V] and the codes [frames, b, 16]."""
    dtype, weight_dtype, kv_cache_dtype = ENGINES[name]
    if kv_cache_dtype == "fp8" and not args.device.startswith("cuda"):
        # Triton's interpreter does not run the kernels faithfully in bfloat16 (the tiny model's
        # logits 1.7x off float32's with the 16-bit cache too): a CPU smoke run keeps float32.
        dtype = torch.float32
    bundle = load(args, dtype, workdir)
    slots = max(args.batches)
    runner = ModelRunner(
        bundle,
        RunnerConfig(
            max_len=args.prompt_len + args.frames + 8,
            max_batch=slots,
            num_slots=slots,
            max_trailing=8,
            use_cuda_graphs=False,
            compile_layers=False,
            fast_path=True,
            weight_dtype=weight_dtype,
            kv_cache_dtype=kv_cache_dtype,
            # the 8-bit cache lives in the Triton kernels (under TRITON_INTERPRET=1 on a CPU)
            decode_kernels="triton" if kv_cache_dtype == "fp8" else "auto",
            fp8_min_rows=0,  # FP8 at every batch here, small ones included (the engine default keeps bf16 there)
        ),
    )
    seen: list[torch.Tensor] = []
    c0 = runner._c0_logits
    runner._c0_logits = lambda *a: seen.append(c0(*a)) or seen[-1]
    ps = prompts(args, runner.hidden)
    out = {}
    if name == "float32":
        with torch.inference_mode():
            out["single_linear"] = single_linear_errors(runner)
    with torch.inference_mode():
        for b in args.batches:
            seqs = []
            for i in range(b):
                seq = Sequence(
                    f"s{i}", ps[i], SamplingParams(greedy=True), seed=i, max_frames=99, cap_reason="length"
                )
                seq.slot = i
                seqs.append(seq)
            runner.active.zero_()
            runner.prefill([PrefillChunk(s, 0, s.num_prefill_positions) for s in seqs])
            runner.start(seqs)
            runner.active[:b] = True
            n, ctx = runner.bucket(b, args.prompt_len + args.frames + 1)
            seen.clear()
            codes = []
            for _ in range(args.frames):
                runner._frame_step(n, ctx)
                codes.append(runner.codes_out[:b].cpu())
            out[b] = {"logits": seen[0][:b].float().cpu(), "codes": torch.stack(codes), "bucket": n}
            print(f"{name}: batch {b} (bucket {n}) done", flush=True)
    runner = bundle = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    lg, lr = got["logits"], ref["logits"]
    keep = torch.isfinite(lr) & torch.isfinite(lg)  # suppressed ids are -inf in both
    diff = torch.where(keep, lg - lr, 0.0)
    base = torch.where(keep, lr, 0.0)
    rel = diff.norm(dim=1) / base.norm(dim=1).clamp_min(1e-12)
    cg, cr = got["codes"], ref["codes"]
    return {
        "frame0_rows_equal": (cg[0] == cr[0]).all(dim=1).float().mean().item(),
        "frame0_c0_equal": (cg[0, :, 0] == cr[0, :, 0]).float().mean().item(),
        "codes_equal": (cg == cr).float().mean().item(),
        "logit_rel_err": rel.mean().item(),
        "logit_max_abs_err": diff.abs().max().item(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke run)")
    ap.add_argument("--batches", default="1,8,64,256,1024")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--embed-std", type=float, default=0.02, help="scale of the random prompt embeddings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batches = sorted(int(x) for x in args.batches.split(",") if x)
    if args.tiny:
        args.prompt_len, args.frames, args.embed_std = min(args.prompt_len, 12), min(args.frames, 3), 1.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("fp8_fidelity needs a CUDA GPU (or --device cpu --tiny)")
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 engine is strict float32
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: run_engine(name, args, Path(tmp)) for name in ENGINES}
    single = runs["float32"].pop("single_linear")
    rows = []
    for b in args.batches:
        for a, r in PAIRS:
            rows.append(
                {
                    "batch": b,
                    "bucket": runs[a][b]["bucket"],
                    "engine": a,
                    "against": r,
                    **compare(runs[a][b], runs[r][b]),
                }
            )
    out = {
        "meta": {
            "model": "tiny" if args.tiny else args.model,
            "device": torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "git": git_revision(),
            "weights": "dummy (seeded random, drawn in float32)",
            "prompt_len": args.prompt_len,
            "frames": args.frames,
            "greedy": True,
            "fp8_scaled_mm_failed": list(fp8._SCALED_MM_FAILED),
        },
        "single_linear_rel_err": single,
        "rows": rows,
    }
    print(
        "\n| batch | bucket | engine | against | frame-0 rows equal | frame-0 c0 equal | codes equal | logit rel err | logit max abs err |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['bucket']} | {r['engine']} | {r['against']} | {r['frame0_rows_equal']:.4f} | "
            f"{r['frame0_c0_equal']:.4f} | {r['codes_equal']:.4f} | {r['logit_rel_err']:.4f} | {r['logit_max_abs_err']:.4f} |"
        )
    print("\none linear against float32 (relative error; first talker / predictor layer):")
    for k, v in single.items():
        print(
            f"  {k:22s} bf16 {v['bf16']:.4f}  fp8 {v['fp8']:.4f}  ratio {v['fp8'] / max(v['bf16'], 1e-12):.1f}"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
