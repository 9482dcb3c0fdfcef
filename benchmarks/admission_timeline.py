"""A burst's first seconds from the talker's admission trace (`--admission-trace`), window by window.

For each window (default 0.2 s) from the burst's start (a plan with at least `--burst` requests
waiting after two seconds without one; the row before it shows the arrivals that made the queue): the streams running and the most waiting, the starts, the refusals at
submission and the wait they were predicted, the steps and the prompts they prefilled, the
median prefill budget, the tightest stream's time left, the queue's measured drain rate, the
admission capacity, the largest room worked out for a gateway, and the commonest reason admission
held (numbers folded). What bound the burst reads off it: a small prefill budget with a tight
stream, a drain rate under the starts the window shows, a capacity under the running streams.

    python -m benchmarks.admission_timeline run/stacks/http1/admission-trace.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.talker.admission_trace import read_trace


def burst_starts(rows: Sequence[dict[str, Any]], waiting: int, quiet_s: float = 2.0) -> list[float]:
    """When each burst began: a plan with at least `waiting` requests queued after `quiet_s`
    without one (a closed loop's levels on one stack are a burst each)."""
    starts: list[float] = []
    last = None
    for row in rows:
        if row.get("kind") != "plan" or (row.get("waiting") or 0) < waiting:
            continue
        if last is None or row["t"] - last >= quiet_s:
            starts.append(row["t"])
        last = row["t"]
    return starts


def _fold(reason: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", reason)[:60]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: Any, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def timeline(
    rows: Sequence[dict[str, Any]], start: float, window_s: float, span_s: float, origin: float | None = None
) -> list[dict[str, Any]]:
    """One dict per window of `window_s` from `start` for `span_s`, each labelled by its start
    from `origin` (default `start`)."""
    origin = start if origin is None else origin
    n = max(1, round(span_s / window_s))
    bins: list[dict[str, list]] = [collections.defaultdict(list) for _ in range(n)]
    for row in rows:
        t = row.get("t")
        if t is None or t < start:
            continue
        i = int((t - start) / window_s + 1e-9)  # a row on a window's edge opens it
        if i < n:
            bins[i][row["kind"]].append(row)
    out = []
    for i, b in enumerate(bins):
        plans, steps, rooms, refusals = b["plan"], b["step"], b["room"], b["refuse"]
        reasons = collections.Counter(_fold(p["reason"]) for p in plans if p.get("reason"))
        waits = [r["predicted_wait_s"] for r in refusals if r.get("predicted_wait_s") is not None]
        out.append(
            {
                "t_s": round(start + i * window_s - origin, 3),
                "running": plans[-1]["running"] if plans else None,
                "waiting_max": max((p["waiting"] for p in plans), default=None),
                "started": sum(p["admitted"] for p in plans),
                "refused": len(refusals) + sum(p["refused"] for p in plans),
                "refused_wait_s": _median(waits),
                "steps": len(steps),
                "prompts": sum(s["prompts"] for s in steps),
                "step_ms": _median([s["seconds"] * 1e3 for s in steps]),
                "prefill_budget": _median(
                    [p["prefill_budget"] for p in plans if p.get("prefill_budget") is not None]
                ),
                "tightest_ms": _median(
                    [p["tightest_s"] * 1e3 for p in plans if p.get("tightest_s") is not None]
                ),
                "drain_per_s": plans[-1].get("drain_per_s") if plans else None,
                "capacity": min(
                    (p["capacity"] for p in plans if p.get("capacity") is not None), default=None
                ),
                "room_max": max((r["accept"] for r in rooms), default=None),
                "reason": reasons.most_common(1)[0][0] if reasons else "",
            }
        )
    return out


FRAME_S = 0.08  # a codec frame: each running stream needs one a frame to keep up
COST_SPANS = 4  # rows of `step_costs` a burst's report shows (a 10 s level's life at 3 s a row)


def step_costs(
    rows: Sequence[dict[str, Any]], start: float, span_s: float, spans: int
) -> list[dict[str, Any]]:
    """The frame steps' cost as measured against admission's model, one dict per `span_s` from
    `start`: a least-squares line through the steps without a prefill (batch over 8), the model's
    base, per-stream and decoder costs at the span's last plan, its capacity range, and the
    stream-frames the steps made a second against the running streams' need (one a frame each).
    On a GPU the decoder shares under MPS, a line with a high base and a low slope beside a model
    with a high slope is contention booked as a per-stream cost (HISTORY.md, sixth session of
    2026-12-07)."""
    out = []
    for i in range(spans):
        lo, hi = start + i * span_s, start + (i + 1) * span_s
        steps = [r for r in rows if r.get("kind") == "step" and lo <= r["t"] < hi]
        plans = [r for r in rows if r.get("kind") == "plan" and lo <= r["t"] < hi]
        if not steps or not plans:
            break
        pure = [(s["batch"], s["seconds"]) for s in steps if not s.get("prompts") and s["batch"] > 8]
        base = slope = None
        if len(pure) >= 3:
            mb = statistics.fmean(b for b, _ in pure)
            ms = statistics.fmean(t for _, t in pure)
            var = sum((b - mb) ** 2 for b, _ in pure)
            if var > 0:
                slope = sum((b - mb) * (t - ms) for b, t in pure) / var
                base = ms - slope * mb
        last = plans[-1]
        caps = [p["capacity"] for p in plans if p.get("capacity") is not None]
        running = statistics.fmean(p["running"] for p in plans)
        out.append(
            {
                "from_s": round(lo - start, 3),
                "steps": len(pure),
                "batch_min": min((b for b, _ in pure), default=None),
                "batch_max": max((b for b, _ in pure), default=None),
                "line_base_ms": None if base is None else base * 1e3,
                "line_slope_us": None if slope is None else slope * 1e6,
                "model_base_ms": last["step_base_s"] * 1e3 if last.get("step_base_s") is not None else None,
                "model_slope_us": (
                    last["step_per_stream_s"] * 1e6 if last.get("step_per_stream_s") is not None else None
                ),
                "decoder_us": last["decoder_frame_s"] * 1e6
                if last.get("decoder_frame_s") is not None
                else None,
                "capacity_min": min(caps, default=None),
                "capacity_max": max(caps, default=None),
                "running": running,
                "frames_per_s": sum(s["batch"] for s in steps) / span_s,
                "needed_per_s": running / FRAME_S,
            }
        )
    return out


def render_costs(spans: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| from s | steps (batch) | line: base ms + us a stream | model: base ms + us a stream, decoder us "
        "| capacity | running | frames stepped / needed a second |",
        "|" + "---|" * 7,
    ]
    for c in spans:
        batch = "-" if c["batch_min"] is None else f"{c['batch_min']}-{c['batch_max']}"
        lines.append(
            f"| {c['from_s']:.1f} | {c['steps']} ({batch}) | {_fmt(c['line_base_ms'], 1)} + "
            f"{_fmt(c['line_slope_us'], 1)} | {_fmt(c['model_base_ms'], 1)} + {_fmt(c['model_slope_us'], 1)}, "
            f"{_fmt(c['decoder_us'], 1)} | {_fmt(c['capacity_min'])}-{_fmt(c['capacity_max'])} "
            f"| {c['running']:.0f} | {c['frames_per_s']:.0f} / {c['needed_per_s']:.0f} |"
        )
    return "\n".join(lines)


def render(windows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| t s | running | waiting max | started | refused (pred. wait s) | steps | prompts | step ms "
        "| prefill budget | tightest ms | drain /s | capacity | room max | held because |"
    )
    lines = [head, "|" + "---|" * 14]
    for w in windows:
        refused = str(w["refused"]) + (
            f" ({w['refused_wait_s']:.1f})" if w["refused_wait_s"] is not None else ""
        )
        lines.append(
            f"| {w['t_s']:.1f} | {_fmt(w['running'])} | {_fmt(w['waiting_max'])} | {w['started']} | {refused} "
            f"| {w['steps']} | {w['prompts']} | {_fmt(w['step_ms'], digits=1)} | {_fmt(w['prefill_budget'])} "
            f"| {_fmt(w['tightest_ms'])} | {_fmt(w['drain_per_s'])} | {_fmt(w['capacity'])} "
            f"| {_fmt(w['room_max'])} | {w['reason']} |"
        )
    return "\n".join(lines)


def report(rows: Sequence[dict[str, Any]], burst: int, window_s: float, span_s: float, name: str) -> str:
    """The timeline of every burst in `rows`."""
    starts = burst_starts(rows, burst)
    if not starts:
        return f"{name}: no plan had {burst} requests waiting"
    parts = []
    for start in starts:
        parts.append(f"{name}: burst from t={start:.3f} s ({burst}+ waiting), {window_s:g} s a row")
        # From one row before it: the arrivals that made the queue.
        parts.append(render(timeline(rows, start - window_s, window_s, span_s + window_s, origin=start)))
        costs = step_costs(rows, start, span_s, COST_SPANS)
        if costs:
            parts.append(f"frame steps against admission's model, {span_s:g} s a row:")
            parts.append(render_costs(costs))
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="admission-trace.jsonl, or .jsonl.gz")
    ap.add_argument("--burst", type=int, default=32, help="requests waiting that mark the burst's start")
    ap.add_argument("--window", type=float, default=0.2, help="seconds a row")
    ap.add_argument("--span", type=float, default=3.0, help="seconds shown from the burst's start")
    args = ap.parse_args(argv)
    print(report(read_trace(args.trace), args.burst, args.window, args.span, str(args.trace)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
