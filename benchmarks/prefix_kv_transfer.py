"""Prompt-prefix KV: fetch (through Redis) vs recompute (prefill) vs the GPU-local cache.

The talker keeps the KV of voice-only prompt prefixes in a GPU-local LRU (`--prefix-cache-mb`).
On a miss it can either prefill the prefix again, or fetch the KV that another talker stored in
speaker_cache/Redis. This script measures, for prefixes of `--lengths` positions of the full-size
talker (seeded random bf16 weights: the same bytes and compute as real ones):

- recompute: prefill of the prefix into a slot, eager and through the captured prefill graphs
  (wall time, synchronised);
- fetch: Redis GET of the serialised KV on this host (loopback; `redis-server` started here, so
  it is a lower bound: a real fetch adds the network and the speaker_cache hop) + bytes -> pinned
  tensor + host-to-device copy into the slot; also the store side (device-to-host + SET);
- hit: the device-to-device copy of a GPU-local cache entry into the slot.

    python -m benchmarks.prefix_kv_transfer --out run/prefix_kv.json
    python -m benchmarks.prefix_kv_transfer --device cpu --tiny      # smoke run, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.revision import git_revision
from benchmarks.timing import median_wall_s
from qtts.engine.model_runner import ModelRunner, RunnerConfig
from qtts.engine.sequence import Sequence
from qtts.engine.slot_scheduler import PrefillChunk
from qtts.model import load_talker_bundle
from services.launcher import free_port


def _median_ms(fn, iters: int) -> float:
    return median_wall_s(fn, iters) * 1e3


class RedisServer:
    """A throw-away `redis-server` on a free loopback port (no persistence); None if unavailable."""

    def __init__(self, binary: str | None) -> None:
        self.binary = binary or shutil.which("redis-server")
        self.proc: subprocess.Popen | None = None
        self.client = None
        self.error: str | None = None

    def __enter__(self) -> RedisServer:
        if not self.binary:
            self.error = "redis-server not found"
            return self
        try:
            import redis
        except ImportError as exc:
            self.error = f"redis-py missing: {exc}"
            return self
        port = free_port()
        env = dict(os.environ)
        libdir = str(Path(self.binary).resolve().parent)
        env["LD_LIBRARY_PATH"] = libdir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--proto-max-bulk-len",
                "1gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        self.client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            try:
                self.client.ping()
                return self
            except Exception:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        err = (
            self.proc.stderr.read().decode(errors="replace")[-300:]
            if self.proc.poll() is not None
            else "no answer"
        )
        self.error = f"redis-server did not start: {err.strip()}"
        self.client = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def measure(runner: ModelRunner, length: int, iters: int, redis_client) -> dict[str, Any]:
    dev = runner.device
    prompt = type("P", (), {})()
    prompt.embeds = torch.randn(length + 1, runner.hidden, device=dev, dtype=runner.dtype) * 0.02
    seq = Sequence("p", prompt, None, seed=0, max_frames=1, cap_reason="length")
    seq.slot = 0
    chunk = [PrefillChunk(seq, 0, length)]
    row: dict[str, Any] = {"positions": length, "kv_bytes": length * runner.bytes_per_position()}
    graphed = runner.prefill_buckets
    runner.prefill_buckets = ()
    row["recompute_eager_ms"] = _median_ms(lambda: runner.prefill(chunk), iters)
    runner.prefill_buckets = graphed
    if runner.prefill_graphs and length <= graphed[-1]:
        row["recompute_graph_ms"] = _median_ms(lambda: runner.prefill(chunk), iters)
    k = runner.k_cache[:, 0, :, :length].clone()
    v = runner.v_cache[:, 0, :, :length].clone()

    # GPU-local hit: the copy `load_prefixes` does.
    def hit() -> None:
        runner.k_cache[:, 1, :, :length] = k
        runner.v_cache[:, 1, :, :length] = v

    row["gpu_cache_hit_ms"] = _median_ms(hit, iters)
    pin = dev.type == "cuda"
    host = torch.empty((2, *k.shape), dtype=k.dtype, pin_memory=pin)

    def to_host() -> None:
        host[0].copy_(k, non_blocking=pin)
        host[1].copy_(v, non_blocking=pin)

    row["device_to_host_ms"] = _median_ms(to_host, iters)
    blob = host.view(torch.uint8).numpy().tobytes()
    staging = torch.empty_like(host)

    def from_bytes(data: bytes) -> None:
        staging.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        runner.k_cache[:, 1, :, :length].copy_(staging[0], non_blocking=pin)
        runner.v_cache[:, 1, :, :length].copy_(staging[1], non_blocking=pin)

    row["bytes_to_slot_ms"] = _median_ms(lambda: from_bytes(blob), iters)
    if redis_client is not None:
        key = f"bench:kv:{length}"
        row["redis_set_ms"] = _median_ms(lambda: redis_client.set(key, blob), iters)
        row["redis_get_ms"] = _median_ms(lambda: redis_client.get(key), iters)
        got = redis_client.get(key)
        if got != blob:
            raise RuntimeError("Redis returned different bytes")
        row["fetch_total_ms"] = _median_ms(lambda: from_bytes(redis_client.get(key)), iters)
        redis_client.delete(key)
        fastest = min(row.get("recompute_graph_ms", float("inf")), row["recompute_eager_ms"])
        row["fetch_over_recompute"] = row["fetch_total_ms"] / fastest
    return row


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen3-tts-12hz-1.7b-base", help="shipped config name or snapshot folder"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke run)")
    ap.add_argument("--lengths", default=None, help="prefix positions, comma separated (default 100,300,600)")
    ap.add_argument("--prefill-buckets", default="128,256,512,1024", help="captured prefill widths (CUDA)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--redis-server", default=None, help="redis-server binary (default: on PATH)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    return args


def _runner(args: argparse.Namespace, lengths: list[int], dtype: torch.dtype) -> ModelRunner:
    """A two-slot runner (dummy weights, graphs captured) whose slots hold the longest prefix."""
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from qtts.tiny_model import build_tiny_snapshot

            model = build_tiny_snapshot(Path(tmp) / "tiny", "base", seed=0)
        else:
            model = args.model
        bundle = load_talker_bundle(model, device=args.device, dtype=dtype, load_format="dummy")
    max_len = max(lengths) + 8
    cfg = RunnerConfig(
        max_len=max_len,
        max_batch=2,
        num_slots=2,
        max_trailing=8,
        context_buckets=(max_len,),
        batch_buckets=(2,),
        prefill_buckets=tuple(int(x) for x in args.prefill_buckets.split(",") if x),
    )
    runner = ModelRunner(bundle, cfg)
    runner.capture_graphs()
    return runner


def _print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a Markdown table (- for a timing not measured)."""
    print(
        "\n| positions | KV MB | recompute eager ms | recompute graph ms | GPU hit ms | Redis GET ms | fetch total ms |"
    )
    print("|---|---|---|---|---|---|---|")

    def f(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "-"

    for r in rows:
        print(
            f"| {r['positions']} | {r['kv_bytes'] / 1e6:.1f} | {f(r, 'recompute_eager_ms')} | "
            f"{f(r, 'recompute_graph_ms')} | {f(r, 'gpu_cache_hit_ms')} | {f(r, 'redis_get_ms')} | "
            f"{f(r, 'fetch_total_ms')} |"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    cuda = str(args.device).startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("prefix_kv_transfer needs a CUDA GPU (or --device cpu --tiny)")
    lengths = [int(x) for x in (args.lengths or ("8,16" if args.tiny else "100,300,600")).split(",") if x]
    dtype = torch.bfloat16 if cuda else torch.float32
    runner = _runner(args, lengths, dtype)
    rows = []
    with RedisServer(args.redis_server) as redis_server:
        for n in lengths:
            rows.append(measure(runner, n, args.iters, redis_server.client))
            print(json.dumps(rows[-1]), flush=True)
            if args.out:  # rows so far, in case a time limit cuts the run
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, indent=2))
    result = {
        "meta": {
            "model": "tiny" if args.tiny else args.model,
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "git": git_revision(),
            "host": platform.node(),
            "weights": "dummy (seeded random)",
            "redis": redis_server.error or "redis-server on loopback (this host)",
            "bytes_per_position": runner.bytes_per_position(),
        },
        "rows": rows,
    }
    _print_table(rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
