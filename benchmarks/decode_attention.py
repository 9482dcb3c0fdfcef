"""The fused decode attention (`triton_ops.decode_attention`) for the 1.7B talker's shape.

At batch 256 an H200 profile put the talker's 28 attention calls at about 140 us each, where the
KV they read (256 rows x 301 positions x 8 heads x 128 x 2 x bf16 = 158 MB) takes 37 us at
4.25 TB/s. This times the kernel's loop variants (the while loop, or the software-pipelined
`range` loop) and tiles (BLOCK_N, num_stages, num_warps) at several row counts and prints each
row count's times next to the bytes floor.

    python -m benchmarks.decode_attention --out run/decode_attention.json
    python -m benchmarks.decode_attention --position 8 --max-len 16 --rows 256,1024 \
        --block-n 16,32 --stages 1 --warps 1,2,4   # predictor-like
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from benchmarks.revision import git_revision
from benchmarks.timing import graph_call_us
from qtts.engine import triton_ops


def bench_rows(m: int, variants, args) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d = 16, 8, 128
    k_cache = torch.randn(m, hkv, args.max_len + 1, d, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(m, hq, d, device=dev, dtype=dt)
    rows = torch.arange(m, device=dev)
    pos = torch.full((m,), args.position, device=dev)
    ref = triton_ops.decode_attention(q, k_cache, v_cache, rows, pos, pipelined=False)
    floor = m * hkv * (args.position + 1) * d * 2 * 2 / args.bandwidth * 1e6
    entry = {"rows": m, "floor_us": round(floor, 2), "variants": []}
    for pipelined, bn, st, w in variants:

        def call(pipelined=pipelined, bn=bn, st=st, w=w):
            return triton_ops.decode_attention(
                q, k_cache, v_cache, rows, pos, block_n=bn, num_stages=st, num_warps=w, pipelined=pipelined
            )

        err = (call().float() - ref.float()).abs().max().item()
        us = graph_call_us(lambda _i: call(), 10)
        entry["variants"].append(
            {
                "pipelined": pipelined,
                "block_n": bn,
                "stages": st,
                "warps": w,
                "us": round(us, 2),
                "max_abs_err": err,
            }
        )
    best = min(entry["variants"], key=lambda v: v["us"])
    base = entry["variants"][0]
    print(
        f"rows {m:5d}: while-loop {base['us']:8.2f} us, best {best['us']:8.2f} us "
        f"(block_n {best['block_n']}, stages {best['stages']}, warps {best['warps']}), floor {floor:7.2f} us"
    )
    return entry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,64,256,1024")
    ap.add_argument("--position", type=int, default=300, help="the query's position (keys 0..position)")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--bandwidth", type=float, default=4.25e12)
    ap.add_argument("--block-n", default="32,64,128", help="key blocks to try, comma separated")
    ap.add_argument("--stages", default="1,2,3,4", help="pipeline stages to try")
    ap.add_argument("--warps", default="4,8", help="warps a program to try")
    ap.add_argument("--out", type=Path, default=Path("run/decode_attention.json"))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    hq, hkv, d = 16, 8, 128
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    variants = [(False, 64, 3, 4)] + [
        (True, bn, st, w)
        for bn, st, w in itertools.product(ints(args.block_n), ints(args.stages), ints(args.warps))
    ]
    result = {
        "git": git_revision(),
        "gpu": torch.cuda.get_device_name(dev),
        "position": args.position,
        "heads": [hq, hkv, d],
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for m in (int(x) for x in args.rows.split(",")):
        entry = bench_rows(m, variants, args)
        result["rows"].append(entry)
        args.out.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
