"""Cost of the forced aligner (Qwen3-ForcedAligner-0.6B, seeded random weights, the shipped
full-size config): device time per second of audio at batch 1 / 8 / 32 / 128.

Each input is `--seconds` of audio at 24 kHz (the talker's rate, resampled as the service does)
with a `--words`-word transcript. Featurising (resampling, log-mel, word splitting, tokenising) is
CPU work on the service's worker thread: it is timed apart, per input (`prepare_ms`). One timed
call is one `ForcedAligner.run` (the encoder per input, one right-padded decoder pass, the argmax
copied back); the median of `--repeats` calls after two warm-up calls. `--engines` picks the
batch paths to time: `graphs` (what the service runs on a GPU: the batch padded to a (batch,
length) bucket, its forward pass captured once as a CUDA graph and replayed), `padded` (the same
pass, eager) and `unpadded` (`ForcedAligner.run`: the audio encoder once per input, eager).

    python -m benchmarks.aligner_cost --out run/aligner_cost.json            # H200, bf16
    python -m benchmarks.aligner_cost --device cpu --dtype float32 --tiny --batches 1,2   # CPU smoke

Prints one JSON line per batch, a table, and writes everything to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qtts.model.aligner import SHIPPED_CONFIG, ForcedAligner, load_aligner
from qtts.model.aligner.batched import BucketedAligner

ENGINES = ("graphs", "padded", "unpadded")

INPUT_RATE_HZ = 24000
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired cats watch from the old stone wall".split()
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--tiny", action="store_true", help="the tiny random aligner (CPU smoke runs)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--engines", default="graphs,unpadded", help="comma list of graphs, padded, unpadded")
    ap.add_argument("--seconds", type=float, default=4.0, help="audio per input")
    ap.add_argument("--words", type=int, default=12, help="words per input's transcript")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    return ap


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load(args: argparse.Namespace) -> ForcedAligner:
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from qtts.tiny_model.aligner import ensure_tiny_aligner

        return load_aligner(ensure_tiny_aligner(), device=args.device, dtype=dtype)
    return load_aligner(SHIPPED_CONFIG, load_format="dummy", device=args.device, dtype=dtype)


def runner(aligner: ForcedAligner, engine: str):
    """The `run(batch)` of an engine (see the module docstring)."""
    if engine == "unpadded":
        return aligner.run
    return BucketedAligner(aligner, cuda_graphs=engine == "graphs").run


def time_batch(run, device: torch.device, batch: list, repeats: int) -> tuple[float, int]:
    """Median seconds of one `run(batch)` and the words it aligned (checks every input came back)."""
    for _ in range(2):
        run(batch)
    times = []
    words = 0
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        out = run(batch)
        _sync(device)
        times.append(time.perf_counter() - t)
        words = sum(len(w) for w in out)
    return statistics.median(times), words


def agreement(aligner: ForcedAligner, engines: Sequence[str], rng: np.random.Generator) -> dict[str, Any]:
    """Per engine, over one batch of inputs of different lengths: the share of word start/end
    times equal to the unpadded path's, and the largest difference (ms)."""
    batch = [
        aligner.prepare(
            (0.1 * rng.standard_normal(int(s * INPUT_RATE_HZ))).astype(np.float32),
            INPUT_RATE_HZ,
            " ".join(WORDS[: 3 + i * 4]),
            "english",
        )
        for i, s in enumerate((0.7, 1.3, 4.0, 7.7))
    ]
    want = [(w.start_s, w.end_s) for words in aligner.run(batch) for w in words]
    out = {}
    for engine in engines:
        if engine == "unpadded":
            continue
        got = [(w.start_s, w.end_s) for words in runner(aligner, engine)(batch) for w in words]
        pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
        out[engine] = {
            "times": len(pairs),
            "equal_share": round(sum(a == b for a, b in pairs) / len(pairs), 4),
            "max_diff_ms": round(max(abs(a - b) for a, b in pairs) * 1e3, 1),
        }
    return out


def row(engine: str, batch: int, seconds: float, words: int, audio_s: float) -> dict[str, Any]:
    return {
        "engine": engine,
        "batch": batch,
        "ms_per_call": round(seconds * 1e3, 3),
        "ms_device_per_audio_s": round(seconds * 1e3 / audio_s, 4),
        "audio_s_per_s": round(audio_s / seconds, 1),
        "words_per_call": words,
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = "| engine | batch | ms per call | device ms per audio-s | audio-s per s | words per call |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['batch']} | {r['ms_per_call']:.2f} | {r['ms_device_per_audio_s']:.3f} "
            f"| {r['audio_s_per_s']:.1f} | {r['words_per_call']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or any(e not in ENGINES for e in engines):
        raise SystemExit(f"--engines: a comma list of {', '.join(ENGINES)}")
    if any(b < 1 for b in batches) or args.seconds <= 0 or args.words < 1 or args.repeats < 1:
        raise SystemExit("--batches, --seconds, --words and --repeats must be positive")
    t0 = time.perf_counter()
    aligner = load(args)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    pcm = (0.1 * rng.standard_normal(int(args.seconds * INPUT_RATE_HZ))).astype(np.float32)
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.words))
    prepare_s = []
    for _ in range(max(3, args.repeats)):
        t = time.perf_counter()
        prepared = aligner.prepare(pcm, INPUT_RATE_HZ, text, "english")
        prepare_s.append(time.perf_counter() - t)
    if len(prepared.words) != args.words:
        raise SystemExit(f"the transcript split into {len(prepared.words)} words, not {args.words}")
    rows = []
    for engine in engines:
        run = runner(aligner, engine)
        for b in batches:
            med, words = time_batch(run, aligner.device, [prepared] * b, args.repeats)
            if words != b * args.words:
                raise SystemExit(f"{engine}, batch {b}: {words} words aligned, expected {b * args.words}")
            rows.append(row(engine, b, med, words, b * args.seconds))
            print(json.dumps(rows[-1]), flush=True)
    device = aligner.device
    result = {
        "model": "tiny random aligner" if args.tiny else f"{SHIPPED_CONFIG} (dummy weights)",
        "dtype": args.dtype,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seconds_per_input": args.seconds,
        "words_per_input": args.words,
        "prompt_tokens": len(prepared.input_ids),
        "prepare_ms_per_input": round(statistics.median(prepare_s) * 1e3, 3),
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
        ),
        "load_s": round(load_s, 1),
        "rows": rows,
        "agreement_with_unpadded": agreement(aligner, engines, rng),
    }
    print(table(rows))
    print(f"timestamps against the unpadded path: {json.dumps(result['agreement_with_unpadded'])}")
    print(
        f"prepare (CPU, one input of {args.seconds:g} s): {result['prepare_ms_per_input']:.2f} ms; "
        f"{result['prompt_tokens']} prompt tokens; {result['model']}, {args.dtype} on {result['gpu']}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
