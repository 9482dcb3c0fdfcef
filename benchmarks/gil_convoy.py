"""How long an engine-like thread's step takes beside a busy Python thread, per GIL switch interval.

The talker's and code2wav's engine threads release the GIL on every GPU wait (graph replay, the
device-to-host copy) and a few more times per step; the asyncio thread serving hundreds of streams
keeps it busy. A released GIL is taken back only when its holder yields, after at most
`sys.getswitchinterval()`. This simulates one step (eight GIL-releasing calls, 2 ms of waiting in
all) alone and beside one thread that runs Python without pause, at several intervals; the
services set the interval with `--gil-switch-interval-ms` (qtts/serving/service_config.py).

This models one engine thread beside one busy thread, not the stack: there a shorter interval
did worse (on an H200, 0.25 ms in every service: 60-63% gap-free streams at c=256 against 83% at
CPython's 5 ms; BENCHMARKS.md), so the services keep 5 ms by default.

    python -m benchmarks.gil_convoy
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def step() -> None:
    time.sleep(0.0001)  # graph replay
    time.sleep(0.002)  # the codes' device-to-host copy waits for the GPU
    for _ in range(6):  # prefill input copies and the like
        time.sleep(0.00005)


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def measure(interval_s: float, with_busy_thread: bool, steps: int) -> tuple[float, float]:
    """(median, max) step milliseconds."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    other = threading.Thread(target=busy, args=(stop,), daemon=True)
    if with_busy_thread:
        other.start()
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        stop.set()
        if with_busy_thread:
            other.join()
        sys.setswitchinterval(old)
    return statistics.median(times), max(times)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals-ms", default="5,1,0.25", help="switch intervals to try, comma separated")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    rows = []
    med, mx = measure(0.005, False, args.steps)
    rows.append({"interval_ms": None, "busy_thread": False, "median_ms": med, "max_ms": mx})
    for ms in (float(x) for x in args.intervals_ms.split(",") if x):
        med, mx = measure(ms / 1e3, True, args.steps)
        rows.append({"interval_ms": ms, "busy_thread": True, "median_ms": med, "max_ms": mx})
    print("| switch interval ms | busy Python thread | step median ms | step max ms |")
    print("|---|---|---|---|")
    for r in rows:
        iv = "-" if r["interval_ms"] is None else f"{r['interval_ms']:g}"
        print(f"| {iv} | {'yes' if r['busy_thread'] else 'no'} | {r['median_ms']:.2f} | {r['max_ms']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
