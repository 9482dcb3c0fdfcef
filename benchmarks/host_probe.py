"""The host under a stack, measured beside each sweep: a pure-Python loop's time and the CPU's use.

Every service's hot path is Python, so a stack's figures follow its host's pace, and lent GPU
machines of one kind differ: on 2026-12-07 one H100 host ran the 3M loop below in 262 ms and the
next day's in 416-576 ms, and the same tree's c=768 closed loop went from 99-100% ok to 54-90%
(benchmarks/HISTORY.md, seventh session). One loop timed per call could not say whether the host
changed between the call's stacks (the second stack of each call did worse). So each sweep of
`launch_gpu_stack.sh` snapshots the host before and after it: the loop's time (on an idle stack,
before the client starts; and after the sweep), and /proc/stat's CPU counters, whose difference
gives the share of the host's cores that were busy (user, system), idle, and stolen by the
hypervisor for other guests (steal: a noisy neighbour shows there, not in any process's time).

    python -m benchmarks.host_probe snap before.json      # before a sweep
    python -m benchmarks.host_probe snap after.json       # after it
    python -m benchmarks.host_probe report before.json after.json --out host-cpu.json

`report` prints one line and writes both snapshots and the shares; `stack_summary` prints the
line of each run's `host-cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# /proc/stat's aggregate "cpu" line, in its order (proc(5)); guest time is already in user.
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
LOOP_N = 3_000_000


def loop_ms(n: int = LOOP_N) -> float:
    """One pure-Python loop's time in ms (run_h200.sh's "python loop of 3M")."""
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return (time.perf_counter() - t) * 1e3


def parse_stat(text: str) -> dict[str, Any]:
    """The aggregate CPU counters (ticks) of a /proc/stat text, and how many CPUs it lists."""
    counters: dict[str, int] | None = None
    cpus = 0
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "cpu":
            values = [int(v) for v in parts[1 : 1 + len(STAT_FIELDS)]]
            values += [0] * (len(STAT_FIELDS) - len(values))  # older kernels: fewer fields
            counters = dict(zip(STAT_FIELDS, values, strict=True))
        elif parts[0].startswith("cpu") and parts[0][3:].isdigit():
            cpus += 1
    if counters is None:
        raise ValueError("no aggregate 'cpu' line in the stat text")
    return {"counters": counters, "cpus": cpus}


def snap(stat_path: str = "/proc/stat", loop: bool = True) -> dict[str, Any]:
    """A snapshot: wall time, the CPU counters, and (with `loop`) the loop's time."""
    taken = {"time": time.time(), **parse_stat(Path(stat_path).read_text())}
    if loop:
        taken["loop_ms"] = round(loop_ms(), 1)
    return taken


def usage(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Shares (0..1) of the CPU time between two snapshots: busy (user + nice + system + irq +
    softirq), user, system, idle (with iowait), steal; and the seconds and CPUs."""
    d = {f: after["counters"][f] - before["counters"][f] for f in STAT_FIELDS}
    total = sum(d.values())
    if total <= 0:
        raise ValueError("the snapshots show no CPU time between them (same snapshot twice?)")
    busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
    return {
        "seconds": round(after["time"] - before["time"], 3),
        "cpus": after.get("cpus") or before.get("cpus"),
        "busy": busy / total,
        "user": (d["user"] + d["nice"]) / total,
        "system": (d["system"] + d["irq"] + d["softirq"]) / total,
        "idle": (d["idle"] + d["iowait"]) / total,
        "steal": d["steal"] / total,
    }


def describe(report: dict[str, Any]) -> str:
    """One line of a `report`: the loop before / after, and the CPU's use over the sweep."""
    u = report["usage"]
    loops = [report["before"].get("loop_ms"), report["after"].get("loop_ms")]
    loop = " / ".join("-" if v is None else f"{v:.0f}" for v in loops)
    return (
        f"host over the sweep ({u['seconds']:.0f} s, {u['cpus']} cpus): busy {u['busy']:.0%} "
        f"(user {u['user']:.0%}, system {u['system']:.0%}), steal {u['steal']:.1%}, idle {u['idle']:.0%}; "
        f"python loop of 3M before / after: {loop} ms"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snap", help="write a snapshot (CPU counters and the loop's time)")
    s.add_argument("out", type=Path)
    s.add_argument("--no-loop", action="store_true", help="counters only (no loop timed)")
    s.add_argument("--stat", default="/proc/stat", help=argparse.SUPPRESS)
    r = sub.add_parser("report", help="the CPU's use between two snapshots")
    r.add_argument("before", type=Path)
    r.add_argument("after", type=Path)
    r.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if args.cmd == "snap":
        if not os.path.exists(args.stat):
            parser.error(f"{args.stat} not found: the probe reads Linux's CPU counters")
        args.out.write_text(json.dumps(snap(args.stat, loop=not args.no_loop)))
        return 0
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    report = {"before": before, "after": after, "usage": usage(before, after)}
    report["line"] = describe(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    print(report["line"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
