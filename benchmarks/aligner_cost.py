"""GPU cost of the forced aligner (Qwen3-ForcedAligner-0.6B, seeded random weights, the shipped
full-size config): seconds of device time per second of audio at batch 1 / 8 / 32 / 128.

Each input is `--seconds` of 16 kHz audio with a `--words`-word transcript, featurised beforehand
(the CPU work of the service's worker threads is not timed); one timed call is one
`ForcedAligner.run` (the encoder per input, one right-padded decoder pass, the argmax copied back),
eager, no CUDA graphs.

    python -m benchmarks.aligner_cost --out run/aligner_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from qtts.model.aligner import SHIPPED_CONFIG, load_aligner

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired cats watch from the old stone wall".split()
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--words", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    aligner = load_aligner(SHIPPED_CONFIG, load_format="dummy", device=args.device, dtype=dtype)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n = int(args.seconds * 16000)
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.words))
    base = [aligner.prepare((0.1 * rng.standard_normal(n)).astype(np.float32), 16000, text, "english")]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        batch = base * b
        for _ in range(2):
            aligner.run(batch)
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            aligner.run(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        audio_s = b * args.seconds
        rows.append(
            {
                "batch": b,
                "ms_per_call": round(med * 1e3, 2),
                "ms_device_per_audio_s": round(med * 1e3 / audio_s, 3),
                "audio_s_per_s": round(audio_s / med, 1),
                "prompt_tokens": len(base[0].input_ids),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "model": SHIPPED_CONFIG,
        "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "seconds_per_input": args.seconds,
        "words_per_input": args.words,
        "load_s": round(load_s, 1),
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
