"""The first chunk's plan on the talker's simulated clock: the open loop of the stack benchmark
(Poisson arrivals, mixed 2-20 s lengths, 300-position voice-clone prompts) through the real
`DeadlineScheduler` and `Admission`, with a GPU stood in by a cost model (`--cost h100`: the
frame step, prefill and code2wav trip of one H100 in the stack at d99e487), for each plan: the
talker's own choice (`StartPlanner`) and one plan for every stream.

    python -m benchmarks.start_plan_sim --rates 20 60 100 150 200 --out run/start-plan-sim.json

No GPU: the figures are the scheduler's, under the cost model; they rank plans and policies, and
the device runs say what a GPU gives. Prints a table; writes every row as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.loadgen import LengthDistribution
from benchmarks.revision import git_revision
from qtts.streams.chunk_plan import BURST_PLAN, STEADY_PLAN, ChunkPlan
from services.talker.admission import Admission, AdmissionConfig
from services.talker.deadline import DeadlinePolicy, DeadlineScheduler
from tests.services.talker.playback_sim import Cost, simulate

COSTS = {
    # One H100 in the stack at d99e487 (HISTORY.md, 2026-12-06): the talker's admission read a
    # step of 5.4 ms + 33 us a stream; packed prefill 5.6 us a position and a few ms a step;
    # chunks spent about 30 ms in code2wav.
    "h100": Cost(
        base_s=0.0054,
        per_stream_s=0.000033,
        prefill_position_s=0.0000056,
        decode_s=0.03,
        prefill_step_s=0.004,
    ),
}
PLANS = {"chosen": None, "one": ChunkPlan(), "two": STEADY_PLAN, "four": BURST_PLAN}


def run(
    rate: float,
    plan: ChunkPlan | None,
    cost: Cost,
    duration_s: float,
    seed: int,
    policy: DeadlinePolicy | None = None,
) -> dict:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 2) + 16))
    times = times[times < duration_s]
    frames = LengthDistribution.parse("mixed:2:20").frames(len(times), seed=seed)
    sched = DeadlineScheduler(
        1024, 2048, admission=Admission(AdmissionConfig()), policy=policy or DeadlinePolicy()
    )
    out = simulate(
        sched,
        [(float(t), n, 300) for t, n in zip(times, frames, strict=True)],
        cost,
        until_s=duration_s + 25,
        plan=plan,
    )
    done = [x for x in out if x.finished_at is not None]
    ttfa = np.array([x.ttfa_s for x in done]) * 1e3
    return {
        "rate": rate,
        "requests": len(out),
        "finished": len(done),
        "ttfa_ms": {q: round(float(np.percentile(ttfa, int(q[1:]))), 1) for q in ("p50", "p95", "p99")}
        if len(ttfa)
        else None,
        "gapped": sum(x.max_underrun_s() > 0 for x in done),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[20, 60, 100, 150])
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--cost", default="h100", choices=list(COSTS))
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--coalesce",
        type=float,
        nargs=3,
        metavar=("MS", "FROM_LOAD", "FULL_LOAD"),
        help="the prefill coalescing wait and the loads it scales between (default: the talker's)",
    )
    args = parser.parse_args()
    cost = COSTS[args.cost]
    policy = DeadlinePolicy()
    if args.coalesce:
        ms, lo, hi = args.coalesce
        policy = DeadlinePolicy(coalesce_s=ms / 1e3, coalesce_from_load=lo, coalesce_full_load=hi)
    rows = []
    print("| rate | plan | finished | TTFA p50 / p95 / p99 ms | gapped |")
    for rate in args.rates:
        for name in args.plans:
            began = time.perf_counter()
            row = {"plan": name, **run(rate, PLANS[name], cost, args.duration, args.seed, policy)}
            row["sim_seconds"] = round(time.perf_counter() - began, 2)
            rows.append(row)
            t = row["ttfa_ms"] or {}
            print(
                f"| {rate:g} | {name} | {row['finished']}/{row['requests']} | "
                f"{t.get('p50')} / {t.get('p95')} / {t.get('p99')} | {row['gapped']} |",
                flush=True,
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "revision": git_revision(),
            "cost": args.cost,
            "duration_s": args.duration,
            "seed": args.seed,
            "coalesce": {
                "ms": policy.coalesce_s * 1e3,
                "from_load": policy.coalesce_from_load,
                "full_load": policy.coalesce_full_load,
            },
        }
        args.out.write_text(json.dumps({"conditions": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
