"""The conditions a `tts-bench` result is recorded with (BENCHMARKS.md, "Conditions"): GPU, served
models, revision, host, request lengths and the command line."""

from __future__ import annotations

import datetime as dt
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from benchmarks.client_config import BenchConfig
from benchmarks.revision import git_revision


def _run(cmd: Sequence[str]) -> str | None:
    try:
        return (
            subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def local_gpu() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return ", ".join(names.splitlines()) if names else None


async def served_models(url: str) -> Any:
    """`GET /v1/models` of the gateway, best effort (recorded with the conditions)."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            response = await client.get(url.rstrip("/") + "/v1/models")
            return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def conditions(cfg: BenchConfig) -> dict[str, Any]:
    """What every reported number must come with (BENCHMARKS.md, "Conditions")."""
    args = cfg.args
    # Best effort even for gRPC: the gateway usually serves both.
    models = await served_models(args.url.split(",")[0].strip())
    model = args.model
    if model is None and isinstance(models, dict) and models.get("data"):
        model = ", ".join(str(m.get("id")) for m in models["data"])
    return {
        "gpu": args.gpu or local_gpu() or "unknown",
        "model": model or "server default",
        "weights": args.weights,
        "tokenizer": args.tokenizer,
        "frames_per_request": frames_text(cfg),
        "length_distribution": {**cfg.lengths.describe(), "realised": None},
        "protocol": args.protocol,
        "task_type": cfg.options.task_type,
        "git_revision": git_revision(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "served_models": models,
        "num_prompts": len(cfg.prompts),
        "reference_audio": args.ref_audio
        or (f"synthetic {args.synthetic_ref_seconds:g} s" if cfg.options.ref_audio else None),
        "voice_mix": (
            f"pool of {len(cfg.options.ref_pool)} synthetic clips, Zipf {cfg.options.ref_pool_zipf:g}"
            if cfg.options.ref_pool
            else "one clip for every request"
        ),
        "x_vector_only": args.x_vector_only,
        "word_timestamps": cfg.options.word_timestamps,
        "command": " ".join(sys.argv),
        "args": vars(args),
    }


def frames_text(cfg: BenchConfig, realised: dict[str, Any] | None = None) -> str:
    """`frames_per_request` of the conditions: the fixed limit, or the mix and what it gave."""
    lengths, fixed = cfg.lengths, " (fixed length)" if cfg.args.fixed_length else ""
    if lengths.is_fixed:
        n = cfg.args.max_new_tokens
        return (f"max {n}" + fixed) if n else "until end of speech"
    text = (
        f"{lengths.spec}: truncated log-normal over {lengths.lo_s:g}-{lengths.hi_s:g} s, "
        f"target mean {lengths.mean_s:g} s, 12.5 frames/s{fixed}"
    )
    if realised:
        text += (
            f"; realised over {realised['num_requests']} requests: mean {realised['mean_s']:.2f} s, "
            f"min {realised['min_s']:.2f} s, max {realised['max_s']:.2f} s"
        )
    return text
