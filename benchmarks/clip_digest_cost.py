"""Host cost of one voice-clone request's reference digest in the gateway, without and with the
per-clip memo (services/gateway/talker_client.py: `reference_bytes` + `reference_digest`, then
`ClipDigests`), for a clip of `--seconds` at 24 kHz:

    python -m benchmarks.clip_digest_cost --out benchmarks/results/<date>-cpu2-clip-digest-cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from benchmarks.revision import git_revision
from qtts.streams.voice_key import reference_digest
from services.gateway.job import SamplingOptions, SynthesisJob
from services.gateway.talker_client import ClipDigests, reference_bytes


def per_request_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=500)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    pcm = np.random.default_rng(0).uniform(-0.5, 0.5, int(args.seconds * 24000)).astype(np.float32)
    job = SynthesisJob(
        request_id="r", text="Hello.", task="voice_clone", voice="", language="english", instructions="",
        reference_audio=b"", reference_text="the reference words", x_vector_only=False, max_new_frames=0,
        sampling=SamplingOptions(), sample_rate=24000, reference_pcm=pcm,
    )  # fmt: skip
    memo = ClipDigests()

    def hashed() -> str:
        return reference_digest(reference_bytes(job), job.reference_text, job.x_vector_only)

    def memoised() -> str:
        digest = memo.get(job)
        if digest is None:
            digest = hashed()
            memo.put(job, digest)
        return digest

    result = {
        "benchmark": "clip_digest_cost",
        "git_revision": git_revision(),
        "host": f"{platform.machine()}, {platform.python_version()}",
        "clip_seconds": args.seconds,
        "repeats": args.repeats,
        "copy_and_hash_ms_per_request": per_request_ms(hashed, args.repeats),
        "memoised_ms_per_request": per_request_ms(memoised, args.repeats),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
