"""The talker's drain forecast at a closed loop's opening burst, on the simulated clock.

The real `DeadlineScheduler` and `Admission` with the H100-like costs of the capacity tests
(`tests/services/talker/test_capacity.py`: `H100_COST`, `H100_ADMISSION`, code2wav sharing the
GPU, a 6 s first-audio budget) through `tests/services/talker/playback_sim.py`, for the cases the
drain rate gets wrong or must keep right:

- `warm_burst`: the benchmark client's voice-pool warm-up (200 two-frame requests at 160 a second),
  a second's pause, then a burst of N voice clones over 0.5 s (N = 384, 512, 768);
- `after_capacity`: 30 s of Poisson arrivals at 90 a second (1.2x what the costs carry), the
  streams ending, the warm-up, then 512 clones;
- `poisson_decoder`: Poisson overloads at 22 / 26 / 30 a second, seeds 0-5, with a decoder of
  0.2 ms a frame sharing the GPU (the admission test's costs): refusals and dry streams;
- `overload_3x`: 66 a second against about 22 carried: refusals that came after waiting (> 50 ms).

    python -m benchmarks.drain_forecast_sim --out benchmarks/results/<date>-cpu-drain-forecast-sim.json

No GPU: the figures are the scheduler's under the cost model. Run it in a tree of another revision
(`git worktree add`) to compare; the JSON records the revision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.revision import git_revision
from services.talker.admission import Admission, AdmissionConfig
from services.talker.deadline import DeadlineScheduler
from tests.services.talker.playback_sim import simulate
from tests.services.talker.test_capacity import H100_ADMISSION, H100_COST
from tests.services.talker.test_deadline_scheduler import COST, poisson_load

WARM = [(i / 160, 2, 299) for i in range(200)]  # the voice-pool warm-up: 200 voices, 8 workers


def _burst_outcome(lis: list, t0: float) -> dict[str, Any]:
    burst = [x for x in lis if x.arrived_at >= t0]
    ok = [x for x in burst if not x.refused]
    return {
        "sent": len(burst),
        "refused": len(burst) - len(ok),
        "dry": sum(1 for x in ok if x.max_underrun_s() > 0),
        "ttfa_max_s": round(max((x.ttfa_s or 0.0) for x in ok), 3) if ok else None,
    }


def warm_burst(n: int) -> dict[str, Any]:
    s = DeadlineScheduler(max_batch=1024, max_waiting=2048, admission=Admission(H100_ADMISSION))
    t0 = WARM[-1][0] + 1.0
    arrivals = WARM + [(t0 + 0.5 * i / n, 125, 299) for i in range(n)]
    lis = simulate(s, arrivals, H100_COST, until_s=t0 + 20, publish_decoder_cost=True)
    return {"case": "warm_burst", "burst": n, **_burst_outcome(lis, t0)}


def after_capacity() -> dict[str, Any]:
    s = DeadlineScheduler(max_batch=1024, max_waiting=2048, admission=Admission(H100_ADMISSION))
    t1 = 45.0
    t0 = t1 + WARM[-1][0] + 1.0
    arrivals = poisson_load(90, 30, 125, 299)
    arrivals += [(t1 + t, f, p) for t, f, p in WARM]
    arrivals += [(t0 + 0.5 * i / 512, 125, 299) for i in range(512)]
    lis = simulate(s, arrivals, H100_COST, until_s=t0 + 20, publish_decoder_cost=True)
    before = [x for x in lis if x.arrived_at < t1]
    return {
        "case": "after_capacity",
        "burst": 512,
        "overload_dry": sum(1 for x in before if not x.refused and x.max_underrun_s() > 0),
        **_burst_outcome(lis, t0),
    }


def poisson_decoder(rate: float, seed: int) -> dict[str, Any]:
    shared = dataclasses.replace(COST, decoder_frame_s=0.0002)
    adm = Admission(AdmissionConfig(decoder_frame_s=0.0002))
    lis = simulate(
        DeadlineScheduler(10_000, 10_000, admission=adm),
        poisson_load(rate, 30, 125, 300, seed=seed),
        shared,
        until_s=60,
    )
    ok = [x for x in lis if not x.refused]
    dry = [x.max_underrun_s() for x in ok if x.max_underrun_s() > 0]
    return {
        "case": "poisson_decoder",
        "rate": rate,
        "seed": seed,
        "sent": len(lis),
        "refused": len(lis) - len(ok),
        "dry": len(dry),
        "dry_max_s": round(max(dry, default=0.0), 4),
    }


def overload_3x() -> dict[str, Any]:
    s = DeadlineScheduler(10_000, 10_000, admission=Admission(AdmissionConfig()))
    lis = simulate(s, poisson_load(66, 30, 125, 300), COST, until_s=60)
    refused = [x for x in lis if x.refused]
    late = [x for x in refused if x.refused_at - x.arrived_at > 0.05]
    return {"case": "overload_3x", "sent": len(lis), "refused": len(refused), "refused_after_50ms": len(late)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    rows = [warm_burst(n) for n in (384, 512, 768)]
    rows.append(after_capacity())
    rows += [poisson_decoder(rate, seed) for rate in (22, 26, 30) for seed in range(6)]
    rows.append(overload_3x())
    for row in rows:
        print(json.dumps(row))
    result = {
        "revision": git_revision(),
        "costs": {"h100": dataclasses.asdict(H100_COST), "decoder_share": dataclasses.asdict(COST)},
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
