"""Host cost of the talker's deadline scheduler: one `DeadlineScheduler.plan()` over N running streams.

And the step's other half on the engine thread: `GenerationLoop._postprocess` of a frame of each.

The plan runs on the engine thread before every frame step, in Python, under the GIL the talker's
event loop also needs; this measures it on the CPU (no GPU work involved), with every stream
playing, its chunk plan known and its lead spread over the urgent-to-max range:

    python -m benchmarks.scheduler_cost --streams 64,256,768,1024
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

from benchmarks.revision import git_revision
from qtts.streams.chunk_plan import ChunkPlan
from services.talker.admission import Admission, AdmissionConfig
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler, ScheduledRequest, StreamCredit


def build(n: int, now: float) -> DeadlineScheduler:
    s = DeadlineScheduler(
        max_batch=max(n, 1), max_waiting=0, admission=Admission(AdmissionConfig()), policy=DeadlinePolicy()
    )
    rng = np.random.default_rng(0)
    plan = ChunkPlan()
    for i in range(n):
        req = ScheduledRequest(
            f"r{i}",
            SimpleNamespace(embeds=np.zeros((300, 1))),
            None,
            None,
            StreamCredit(8, 10**6),
            lambda e: None,
        )
        s.submit(req, now)
        s.plan(now)
        elapsed = float(rng.uniform(0.5, 8.0))
        lead = float(rng.uniform(1.5, 4.0))
        req.stepped = True
        req.first_audio_at = now - elapsed
        req.credit.generated = int((elapsed + lead) / 0.08)
        req.delivered_s = plan.end_at_or_below(req.credit.generated) * 0.08
        req.chunk_plan = plan
    # Admission holds back what its default costs say the GPU cannot carry (593 of 1,024 on
    # this project's defaults); the plan is timed over all N playing, so those join directly.
    while s.waiting:
        req = s.waiting.popleft()
        s.running[req.request_id] = req
    return s


class _NoGpu:
    """A generator whose steps the benchmark hands to the loop itself."""

    def __init__(self, slots: int):
        self.max_batch = slots

    def step(self, skip: object = (), prefill_budget: object = None) -> list:
        return []


def postprocess_times(n: int, now: float, iters: int) -> list[float]:
    """Seconds of `GenerationLoop._postprocess` for a frame of each of `n` playing streams (the
    engine thread's work after every step: frames to the streams, chunks handed on), `iters` steps."""
    from prometheus_client import CollectorRegistry

    from qtts.model.step_output import StepOutput
    from qtts.serving.metrics import TalkerMetrics
    from services.talker.generation_loop import GenerationLoop

    s = build(n, now)
    loop = GenerationLoop(_NoGpu(n), s, TalkerMetrics(CollectorRegistry()))
    streams = list(s.running.values())
    for req in streams:
        req.sink = lambda event: None
    plan = s.plan(now)
    plan.stepping = streams
    host = np.full((n, 16), 5, np.int16)  # one step's codes, as the GraphEngine's host array
    times = []
    for _ in range(iters):
        outputs = [StepOutput(r.request_id, host[i], False, None) for i, r in enumerate(streams)]
        t0 = time.perf_counter()
        loop._postprocess(plan, outputs, 0.03, 0)
        times.append(time.perf_counter() - t0)
    return times


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="64,256,768,1024")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.streams.split(",")):
        now = 1000.0
        s = build(n, now)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            s.plan(now)
            times.append(time.perf_counter() - t0)
        post = postprocess_times(n, now, args.iters)
        rows.append(
            {
                "streams": n,
                "plan_ms_median": 1e3 * statistics.median(times),
                "plan_ms_max": 1e3 * max(times),
                "postprocess_ms_median": 1e3 * statistics.median(post),
                "postprocess_ms_max": 1e3 * max(post),
            }
        )
        r = rows[-1]
        print(
            f"streams {n:5d}: plan {r['plan_ms_median']:.3f} ms median, {r['plan_ms_max']:.3f} ms max; "
            f"postprocess {r['postprocess_ms_median']:.3f} ms median, {r['postprocess_ms_max']:.3f} ms max"
        )
    if args.out:
        with open(args.out, "w") as f:
            host = {"cpu": cpu_name(), "python": sys.version.split()[0]}
            json.dump(
                {"revision": git_revision(), "host": host, "iters": args.iters, "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
