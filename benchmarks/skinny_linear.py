"""Few-row matmuls of the frame step: cuBLAS (F.linear) against `triton_ops.skinny_linear` tiles.

At decode batches the frame step's matmuls have 1-16 rows and are bound by reading the weight, yet
an H200 profile of the 1.7B step showed them at 5-11 us each, far from the bytes/bandwidth time.
This sweeps the skinny kernel's tiles (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) for every weight
shape of the 1.7B talker and code predictor and prints, per shape and row count, cuBLAS's time,
the best tile's time and the floor (weight bytes / `--bandwidth`).

Every call reads a different copy of the weight (copies add up to more than the L2 cache), inside
one CUDA graph, so a call's time is what it costs between other kernels of a replayed step.

    python -m benchmarks.skinny_linear --out run/skinny_linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.revision import git_revision
from benchmarks.timing import graph_call_us
from qtts.engine import triton_ops

# (name, N, K, bias) of the 1.7B model's decode matmuls (the predictor runs 15 times a frame).
SHAPES = [
    ("predictor.qkv", 4096, 1024, False),
    ("predictor.o", 1024, 2048, False),
    ("predictor.gate_up", 6144, 1024, False),
    ("predictor.down", 1024, 3072, False),
    ("predictor.lm_head", 2048, 1024, False),
    ("predictor.proj", 1024, 2048, True),
    ("talker.qkv", 4096, 2048, False),
    ("talker.o", 2048, 2048, False),
    ("talker.gate_up", 12288, 2048, False),
    ("talker.down", 2048, 6144, False),
    ("talker.codec_head", 3072, 2048, False),
]


def configs(n: int, sms: int):
    for bn, bk, sk, warps, stages in itertools.product((16, 32, 64), (128, 256), (1, 2, 4), (4,), (3, 5)):
        if triton_ops.triton.cdiv(n, bn) * sk <= 4 * sms:
            yield (bn, bk, sk, warps, stages)


def _tile_scores(
    name: str, n: int, sms: int, tune_rows: list[int], xs: dict, ws: list, bias: torch.Tensor | None
) -> dict[tuple, float]:
    """Every tile's summed graph-replay time (us) over the tuning row counts (every row count up
    to 16 compiles to the same BLOCK_M); a tile that does not compile is told and skipped."""
    copies = len(ws)
    scores: dict[tuple, float] = {}
    for cfg in configs(n, sms):
        total = 0.0
        try:
            for m in tune_rows:
                total += graph_call_us(
                    lambda i, m=m, cfg=cfg: triton_ops.skinny_linear(xs[m], ws[i], bias, cfg), copies
                )
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
            print(f"  {name} tile {cfg}: {type(exc).__name__}: {exc}"[:200])
            continue
        scores[cfg] = total
    return scores


def sweep_shape(
    name: str, n: int, k: int, has_bias: bool, rows: list[int], tune_rows: list[int], args, l2: int, sms: int
) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    nbytes = n * k * 2
    copies = max(2, int(args.l2_multiple * l2 / nbytes) + 1)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * k**-0.5 for _ in range(copies)]
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g) if has_bias else None
    xs = {m: torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g) for m in rows}
    scores = _tile_scores(name, n, sms, tune_rows, xs, ws, bias)
    best = min(scores, key=scores.get)
    entry = {
        "name": name,
        "n": n,
        "k": k,
        "bias": has_bias,
        "copies": copies,
        "best_tile": list(best),
        "tiles": [
            {"tile": list(c), "us_sum_tune_rows": round(s, 3)}
            for c, s in sorted(scores.items(), key=lambda kv: kv[1])[:8]
        ],
        "rows": [],
    }
    for m in rows:
        ref = F.linear(xs[m], ws[0], bias)
        got = triton_ops.skinny_linear(xs[m], ws[0], bias, best) if m <= 64 else ref
        err = (got.float() - ref.float()).abs().max().item()
        cublas = graph_call_us(lambda i, m=m: F.linear(xs[m], ws[i], bias), copies)
        skinny = (
            graph_call_us(lambda i, m=m: triton_ops.skinny_linear(xs[m], ws[i], bias, best), copies)
            if m <= 64
            else None
        )
        floor = (nbytes + m * k * 2 + m * n * 2) / args.bandwidth * 1e6
        entry["rows"].append(
            {
                "m": m,
                "cublas_us": round(cublas, 3),
                "skinny_us": None if skinny is None else round(skinny, 3),
                "floor_us": round(floor, 3),
                "max_abs_err": err,
            }
        )
        print(
            f"{name:20s} {n:6d} {k:5d} {m:3d} {cublas:10.2f} {skinny or float('nan'):10.2f} {floor:9.2f}  {best}"
        )
    return entry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--tune-rows", default="2,16", help="row counts the tile sweep runs at")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--bandwidth", type=float, default=4.25e12, help="bytes/s for the floor (DESIGN.md 6)")
    ap.add_argument(
        "--l2-multiple", type=float, default=4.0, help="weight copies add up to this many L2 sizes"
    )
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds; later shapes are skipped")
    ap.add_argument("--out", type=Path, default=Path("run/skinny_linear.json"))
    args = ap.parse_args(argv)

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    rows = [int(r) for r in args.rows.split(",")]
    tune_rows = [int(r) for r in args.tune_rows.split(",")]
    wanted = set(args.shapes.split(",")) if args.shapes else None
    t0 = time.monotonic()
    result = {
        "git": git_revision(),
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton_ops.triton.__version__,
        "dtype": "bfloat16",
        "shapes": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"{'shape':20s} {'N':>6s} {'K':>5s} {'M':>3s} {'cublas us':>10s} {'skinny us':>10s} {'floor us':>9s}  tile"
    )
    for name, n, k, has_bias in SHAPES:
        if wanted and name not in wanted:
            continue
        if time.monotonic() - t0 > args.time_limit:
            print(f"time limit: {name} and later shapes skipped")
            break
        entry = sweep_shape(name, n, k, has_bias, rows, tune_rows, args, l2, props.multi_processor_count)
        result["shapes"].append(entry)
        args.out.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
