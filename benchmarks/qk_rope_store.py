"""The frame step's per-head norm, RoPE and KV store (`triton_ops.qk_norm_rope_store`) by tile.

An H200 profile (2026-12-04, 2dcadee) put this kernel at 2.36 ms of a 24.8 ms frame step at batch
1,024 (103 calls, ~23 us each), where the bytes it moves (a token's q|k|v read, q and k|v written:
about 16 kB a token for the 1.7B talker's 16 + 8 heads of 128) take about 4 us at 4.25 TB/s.
This times the kernel's tiles (query|key heads a program, warps a program) at several row counts,
each inside a captured CUDA graph as in the frame step, and prints them beside the bytes floor.

    python -m benchmarks.qk_rope_store --out run/qk_rope_store.json
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


def bench_rows(m: int, args: argparse.Namespace) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d = args.heads, args.kv_heads, 128
    slots = max(m, 1)
    qkv = torch.randn(m, (hq + 2 * hkv) * d, device=dev, dtype=dt)
    qn = torch.rand(d, device=dev, dtype=dt) + 0.5
    kn = torch.rand(d, device=dev, dtype=dt) + 0.5
    pos = torch.randint(0, args.max_len, (m,), device=dev)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = pos[:, None].float() * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], dim=1).to(dt)
    sin = torch.cat([ang.sin(), ang.sin()], dim=1).to(dt)
    k_cache = torch.zeros(slots, hkv, args.max_len, d, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    rows = torch.randperm(slots, device=dev)[:m]
    floor = m * ((hq + 2 * hkv) * d * 2 + (hq + 2 * hkv) * d * 2) / args.bandwidth * 1e6
    entry = {"rows": m, "floor_us": round(floor, 2), "variants": []}
    ref = triton_ops.qk_norm_rope_store(qkv, qn, kn, cos, sin, k_cache, v_cache, rows, pos, 1e-6, hq, hkv)
    ref_k = k_cache.clone()
    for hb, w in itertools.product(args.heads_per_program, args.warps):

        def call(_i: int = 0, hb: int = hb, w: int = w):
            return triton_ops.qk_norm_rope_store(
                qkv, qn, kn, cos, sin, k_cache, v_cache, rows, pos, 1e-6, hq, hkv,
                heads_per_program=hb, num_warps=w,
            )  # fmt: skip

        k_cache.zero_()
        err = max(
            (call().float() - ref.float()).abs().max().item(),
            (k_cache.float() - ref_k.float()).abs().max().item(),
        )
        us = graph_call_us(call, 10)
        entry["variants"].append(
            {"heads_per_program": hb, "warps": w, "us": round(us, 2), "max_abs_err": err}
        )
    best = min(entry["variants"], key=lambda v: v["us"])
    now = next(
        (
            v
            for v in entry["variants"]
            if v["heads_per_program"] == triton_ops.QK_HEADS_PER_PROGRAM and v["warps"] == 4
        ),
        None,
    )
    print(
        f"rows {m:5d}: now {now['us'] if now else float('nan'):8.2f} us, best {best['us']:8.2f} us "
        f"({best['heads_per_program']} heads, {best['warps']} warps), floor {floor:7.2f} us",
        flush=True,
    )
    return entry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,256,1024")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--bandwidth", type=float, default=4.25e12)
    ap.add_argument("--heads-per-program", default="2,4,8,16,32")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--out", type=Path, default=Path("run/qk_rope_store.json"))
    args = ap.parse_args(argv)
    args.heads_per_program = [int(x) for x in args.heads_per_program.split(",")]
    args.warps = [int(x) for x in args.warps.split(",")]
    dev = torch.device("cuda")
    result = {"git": git_revision(), "gpu": torch.cuda.get_device_name(dev), "rows": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for m in (int(x) for x in args.rows.split(",")):
        result["rows"].append(bench_rows(m, args))
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
