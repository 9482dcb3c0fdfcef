"""Cost of computing one new voice's prompt (`TalkerBundle.compute_voice_prompt`): the speaker
encoder's x-vector and the codec encoder's reference codes of a reference clip, alone on the
device, split by encoder, with the profiler's top operators.

    python -m benchmarks.voice_prompt_cost --device cuda --out benchmarks/results/<date>-h200-voice-prompt.json

In the stack a burst of new voices waits on these one at a time (services/talker/voices.py), so
their cost per clip bounds how fast a pool of new voices reaches first audio.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from benchmarks.reference_audio import synthetic_reference_wav
from benchmarks.revision import git_revision
from qtts.model.bundle import load_talker_bundle


def clip_pcm(seconds: float, seed: int) -> np.ndarray:
    import io
    import wave

    with wave.open(io.BytesIO(synthetic_reference_wav(seconds, seed))) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clips", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    bundle = load_talker_bundle(args.model, device=args.device, dtype=torch.bfloat16, load_format="dummy")
    clips = [clip_pcm(args.seconds, seed) for seed in range(args.clips + 2)]
    for pcm in clips[:2]:  # warm-up: kernels, allocator
        bundle.compute_voice_prompt(pcm, "reference words", False)
    rows = []
    with torch.inference_mode():
        for pcm in clips[2:]:
            wav = torch.as_tensor(pcm)
            rows.append(
                {
                    "whole_ms": timed(
                        lambda p=pcm: bundle.compute_voice_prompt(p, "reference words", False), args.device
                    ),
                    "speaker_ms": timed(lambda w=wav: bundle.speaker_encoder.embed(w), args.device),
                    "codec_ms": timed(lambda w=wav: bundle.codec_encoder.encode(w), args.device),
                }
            )
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for pcm in clips[2:5]:
            bundle.compute_voice_prompt(pcm, "reference words", False)
    sort = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=15)
    by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    summary = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    result = {
        "benchmark": "voice_prompt_cost",
        "git_revision": git_revision(),
        "model": args.model,
        "weights": "dummy (seeded random), bfloat16",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "clip_seconds": args.seconds,
        "clips": args.clips,
        "median_ms": summary,
        "rows": rows,
        "profile_by_device_time": table,
        "profile_by_host_time": by_cpu,
    }
    print(
        f"voice prompt of a {args.seconds:g} s clip: {summary['whole_ms']:.1f} ms "
        f"(speaker encoder {summary['speaker_ms']:.1f} ms, codec encoder {summary['codec_ms']:.1f} ms), median of {len(rows)}"
    )
    print(table)
    print(by_cpu)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
