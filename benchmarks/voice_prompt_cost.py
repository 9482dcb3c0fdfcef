"""Cost of new voices' prompts: one clip alone on the device, split by encoder (speaker encoder's
x-vector, codec encoder's reference codes), and N new voices arriving at once through the
talker's `VoiceResolver` and its voice worker process (what a cold voice mix costs).

    python -m benchmarks.voice_prompt_cost --device cuda --burst 1,8,32,128 \\
        --out benchmarks/results/<date>-h200-voice-prompt.json

`--lengths equal` gives every burst clip the same length (the benchmark's synthetic voice pool:
such clips go through each encoder together); `--lengths mixed` draws 2-10 s (one by one). Each
burst row gives the time to the last prompt, per-voice latency percentiles, the worker's batches,
and the queue wait against the computation time (the talker's stages voice_prompt_queue and
compute_voice_prompt); beside it the same N clips computed in this process one after another
(the floor of the old path, where one thread computed one voice at a time) and in one
`compute_many` (batching without the process hop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
import torch

from benchmarks.reference_audio import synthetic_reference_wav
from benchmarks.revision import git_revision
from qtts.model.voice_encoders import VoiceClip, load_voice_encoders

REF_TEXT = "reference words"


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


def alone(encoders, args) -> dict:
    """One clip at a time on an idle device, whole and by encoder, with the profiler's top ops."""
    clips = [clip_pcm(args.seconds, seed) for seed in range(args.clips + 2)]
    for pcm in clips[:2]:  # warm-up: kernels, allocator
        encoders.compute(VoiceClip(pcm, REF_TEXT, False))
    rows = []
    with torch.inference_mode():
        for pcm in clips[2:]:
            wav = torch.as_tensor(pcm)
            rows.append(
                {
                    "whole_ms": timed(
                        lambda p=pcm: encoders.compute(VoiceClip(p, REF_TEXT, False)), args.device
                    ),
                    "speaker_ms": timed(lambda w=wav: encoders.speaker_encoder.embed(w), args.device),
                    "codec_ms": timed(lambda w=wav: encoders.codec_encoder.encode(w), args.device),
                }
            )
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for pcm in clips[2:5]:
            encoders.compute(VoiceClip(pcm, REF_TEXT, False))
    return {
        "median_ms": {k: float(np.median([r[k] for r in rows])) for k in rows[0]},
        "rows": rows,
        "profile_by_device_time": prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=15
        ),
        "profile_by_host_time": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }


def burst_clips(n: int, lengths: str, seconds: float, seed0: int) -> list[np.ndarray]:
    """N distinct clips (seeds never reused across bursts, so every voice is cold)."""
    rng = np.random.default_rng(seed0)
    if lengths == "equal":
        return [clip_pcm(seconds, seed0 + i) for i in range(n)]
    return [clip_pcm(round(float(rng.uniform(2.0, 10.0)), 2), seed0 + i) for i in range(n)]


def stage_totals(registry, stage: str) -> tuple[float, float]:
    labels = {"service": "talker", "stage": stage}
    count = registry.get_sample_value("tts_stage_latency_seconds_count", labels) or 0.0
    total = registry.get_sample_value("tts_stage_latency_seconds_sum", labels) or 0.0
    return count, total


async def burst(resolver, registry, clips: list[np.ndarray]) -> dict:
    """N new voices asked for at once through the resolver and its worker."""
    from services.talker.request import GenerationRequest

    async def one(i: int, pcm: np.ndarray) -> float:
        req = GenerationRequest(
            f"v{i}", "hello", reference_pcm_f32=pcm.astype("<f4").tobytes(), reference_text=REF_TEXT
        )
        started = time.perf_counter()
        await resolver.resolve(req)
        return (time.perf_counter() - started) * 1e3

    batcher = resolver.batcher
    batches_before, batcher.largest_batch = batcher.batches, 0
    queued_before = stage_totals(registry, "voice_prompt_queue")
    computed_before = stage_totals(registry, "compute_voice_prompt")
    started = time.perf_counter()
    latencies = await asyncio.gather(*(one(i, pcm) for i, pcm in enumerate(clips)))
    total_ms = (time.perf_counter() - started) * 1e3
    queued = np.subtract(stage_totals(registry, "voice_prompt_queue"), queued_before)
    computed = np.subtract(stage_totals(registry, "compute_voice_prompt"), computed_before)
    return {
        "all_prompts_ms": total_ms,
        "voice_ms_p50": float(np.percentile(latencies, 50)),
        "voice_ms_p95": float(np.percentile(latencies, 95)),
        "voice_ms_max": float(np.max(latencies)),
        "batches": batcher.batches - batches_before,
        "largest_batch": batcher.largest_batch,
        "queue_wait_ms_mean": float(queued[1] / max(queued[0], 1) * 1e3),
        "compute_ms_mean": float(computed[1] / max(computed[0], 1) * 1e3),
    }


async def bursts(encoders, args) -> list[dict]:
    from prometheus_client import CollectorRegistry

    from qtts.serving.metrics import TalkerMetrics
    from services.talker.speaker_cache_client import SpeakerCacheClient
    from services.talker.voice_worker import VoiceWorker, VoiceWorkerSpec
    from services.talker.voices import VoiceResolver

    worker = VoiceWorker(VoiceWorkerSpec(args.model, args.device, "bfloat16", "dummy"))
    await asyncio.to_thread(worker.start)
    registry = CollectorRegistry()
    resolver = VoiceResolver(
        None, SpeakerCacheClient(None), model_id="bench", metrics=TalkerMetrics(registry), worker=worker
    )
    rows = []
    try:
        await burst(resolver, registry, burst_clips(4, args.lengths, args.seconds, 10_000))  # warm-up
        for k, n in enumerate(int(x) for x in args.burst.split(",")):
            clips = burst_clips(n, args.lengths, args.seconds, 20_000 + 1000 * k)
            row = {"voices": n, "lengths": args.lengths, **await burst(resolver, registry, clips)}
            voice_clips = [VoiceClip(pcm, REF_TEXT, False) for pcm in clips]
            row["in_process_one_by_one_ms"] = timed(
                lambda c=voice_clips: [encoders.compute(x) for x in c], args.device
            )
            row["in_process_batched_ms"] = timed(lambda c=voice_clips: encoders.compute_many(c), args.device)
            rows.append(row)
            print(
                f"{n:4d} new voices at once ({args.lengths}): all prompts in {row['all_prompts_ms']:.0f} ms "
                f"(voice p50 {row['voice_ms_p50']:.0f} / p95 {row['voice_ms_p95']:.0f} ms; "
                f"{row['batches']} batches, largest {row['largest_batch']}; queue "
                f"{row['queue_wait_ms_mean']:.1f} ms vs compute {row['compute_ms_mean']:.1f} ms a voice); in "
                f"this process one by one {row['in_process_one_by_one_ms']:.0f} ms, batched "
                f"{row['in_process_batched_ms']:.0f} ms"
            )
    finally:
        await resolver.close()  # stops the worker
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/qwen3-tts-12hz-1.7b-base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clips", type=int, default=12)
    ap.add_argument("--burst", default="", help="comma-separated numbers of new voices arriving at once")
    ap.add_argument("--lengths", choices=("equal", "mixed"), default="equal")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.burst and not all(x.strip().isdigit() and int(x) > 0 for x in args.burst.split(",")):
        ap.error(f"--burst takes positive counts separated by commas, got {args.burst!r}")
    encoders = load_voice_encoders(args.model, device=args.device, dtype=torch.bfloat16, load_format="dummy")
    result = {
        "benchmark": "voice_prompt_cost",
        "git_revision": git_revision(),
        "model": args.model,
        "weights": "dummy (seeded random), bfloat16",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "clip_seconds": args.seconds,
        "clips": args.clips,
        **alone(encoders, args),
    }
    summary = result["median_ms"]
    print(
        f"voice prompt of a {args.seconds:g} s clip: {summary['whole_ms']:.1f} ms (speaker encoder "
        f"{summary['speaker_ms']:.1f} ms, codec encoder {summary['codec_ms']:.1f} ms), median of {args.clips}"
    )
    print(result["profile_by_device_time"])
    print(result["profile_by_host_time"])
    if args.burst:
        result["bursts"] = asyncio.run(bursts(encoders, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
