"""Benchmark output: one JSON file (conditions, per-request records, aggregates), a Markdown
table, and PNG plots (latency CDF, max underrun per request, TTFA and underrun against load).

A result is a plain dict so a saved `results.json` can be loaded and re-rendered:
`{"conditions": {...}, "levels": [{"mode", "concurrency", "rate", "wall_s", "aborted",
"hit_deadline", "gap_free", "aggregates", "records"}], "highest_gap_free_load": {...}}`.

A level is *gap-free* when every request succeeded (no refusal, no error) with zero underrun, and
none was aborted by the time limit. The highest gap-free load of a run is, per mode, the highest
closed-loop concurrency and the highest open-loop rate among the gap-free levels (Nari Labs'
protocol: a row with any underrun or failure does not pass).

`python -m benchmarks.report headline` draws the plot at the top of BENCHMARKS.md (first audio and
the gap-free share against load, closed and open loop) from the recorded runs in
`benchmarks/results/` that the headline table cites (`HEADLINE_RUNS`), beside the peers' published
first-audio figures; tests/benchmarks/test_report.py checks that the committed image is what this
makes.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import matplotlib
import numpy as np
from matplotlib.figure import Figure  # Figure without pyplot: no global state, Agg canvas
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from benchmarks.loadgen import LevelRun
from benchmarks.metrics import percentiles, summarize

JSON_NAME = "results.json"
MARKDOWN_NAME = "results.md"
PLOT_NAMES = ("latency_cdf.png", "underrun_per_request.png", "ttfa_vs_load.png")
UNDERRUN_SLO_MS = 100.0


def level_result(
    mode: str, run: LevelRun, *, concurrency: int | None = None, rate: float | None = None
) -> dict[str, Any]:
    """The JSON-ready result of one load level."""
    aggregates = summarize(run.records, run.wall_s)
    level = {
        "mode": mode,
        "concurrency": concurrency,
        "rate": rate,
        "wall_s": run.wall_s,
        "aborted": run.aborted,
        "hit_deadline": run.hit_deadline,
        "gap_free": is_gap_free(aggregates, aborted=run.aborted, hit_deadline=run.hit_deadline),
        "aggregates": aggregates,
        "records": [r.to_dict() for r in run.records],
    }
    if run.loop_lag_s:
        level["client_loop_lag_ms"] = loop_lag_summary(run.loop_lag_s)
    return level


def loop_lag_summary(samples: Sequence[float]) -> dict[str, Any]:
    """p50 / p99 / max of the client's event-loop lag samples, in ms, and how many there were."""
    q = percentiles((s * 1e3 for s in samples), (50, 99))
    return {key: round(q[key], 2) for key in ("p50", "p99", "max")} | {"samples": len(samples)}


def is_gap_free(aggregates: dict[str, Any], *, aborted: int = 0, hit_deadline: bool = False) -> bool:
    """Every request of the level succeeded with a max underrun of exactly 0, none aborted."""
    n = aggregates["num_requests"]
    # pass_rate == 1: every request ok *and* zero underrun (ok requests without audio do not pass).
    return bool(n) and aggregates["pass_rate"] == 1.0 and not aborted and not hit_deadline


def _level_gap_free(level: dict[str, Any]) -> bool:
    if "gap_free" in level:
        return bool(level["gap_free"])
    return is_gap_free(level["aggregates"], aborted=level["aborted"], hit_deadline=level["hit_deadline"])


def highest_gap_free_load(levels: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode that ran: its loads, the gap-free ones, the highest gap-free (None when none), and
    the loads below that highest which did not pass (a non-monotone sweep is worth a look)."""
    out: dict[str, Any] = {}
    for mode, key in (("closed", "concurrency"), ("open", "rate")):
        group = [lv for lv in levels if lv["mode"] == mode]
        if not group:
            continue
        loads = sorted({lv[key] for lv in group})
        # A load measured twice passes only if every measurement of it passed.
        passing = [x for x in loads if all(_level_gap_free(lv) for lv in group if lv[key] == x)]
        highest = max(passing) if passing else None
        out[mode] = {
            "key": key,
            "loads": loads,
            "gap_free": passing,
            "highest": highest,
            "not_gap_free_below_highest": [
                x for x in loads if highest is not None and x < highest and x not in passing
            ],
        }
    return out


def _load_text(mode: Literal["closed", "open"], value: float) -> str:
    return f"c={value}" if mode == "closed" else f"{value:g} req/s"


def gap_free_lines(levels: Sequence[dict[str, Any]]) -> list[str]:
    """The highest gap-free load, one line per mode that ran."""
    summary = highest_gap_free_load(levels)
    lines = []
    for mode, title in (("closed", "closed loop"), ("open", "open loop")):
        if mode not in summary:
            continue
        s = summary[mode]
        if s["highest"] is None:
            tried = ", ".join(_load_text(mode, x) for x in s["loads"])
            text = f"none (no level passed: {tried})"
        else:
            text = _load_text(mode, s["highest"])
            if s["not_gap_free_below_highest"]:
                below = ", ".join(_load_text(mode, x) for x in s["not_gap_free_below_highest"])
                text += f" (but {below} did not pass)"
        lines.append(f"Highest gap-free load ({title}, zero underruns and 100% success): {text}")
    return lines


def load_label(level: dict[str, Any]) -> str:
    if level["mode"] == "closed":
        return f"c={level['concurrency']}"
    return f"{level['rate']:g} req/s"


def _ms(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value * 1000, fmt)


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


TABLE_HEADER = (
    "| load | n | ok | refused | refusal p50/p95 ms | audio p50 s | TTFA p50/p95/p99 ms | TTFA p99/p50 "
    "| audible p50 ms | E2E p50/p95 s | RTF p50/p95 | max underrun p95/p99 ms | zero underrun | gap-free "
    "| xRT | req/s |"
)


def markdown_table(levels: Sequence[dict[str, Any]]) -> str:
    """One row per load level."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for level in levels:
        a = level["aggregates"]
        t, e, r, u = a["ttfa_s"], a["e2e_s"], a["rtf"], a["max_underrun_s"]
        # Results written before refusals were counted apart have none of these keys.
        refusal = a.get("refusal_latency_s") or {}
        lines.append(
            f"| {load_label(level)} | {a['num_requests']} | {_pct(a['success_rate'])} "
            f"| {_pct(a.get('refused_share'))} | {_ms(refusal.get('p50'), '.1f')}/{_ms(refusal.get('p95'), '.1f')} "
            f"| {_num(a['audio_s']['p50'])} "
            f"| {_ms(t['p50'])}/{_ms(t['p95'])}/{_ms(t['p99'])} | {_num(a.get('ttfa_p99_over_p50'))} "
            f"| {_ms(a['first_audible_s']['p50'])} "
            f"| {_num(e['p50'])}/{_num(e['p95'])} | {_num(r['p50'], '.3f')}/{_num(r['p95'], '.3f')} "
            f"| {_ms(u['p95'])}/{_ms(u['p99'])} | {_pct(a['zero_underrun_share'])} "
            f"| {'yes' if _level_gap_free(level) else 'no'} "
            f"| {_num(a['xrt'], '.1f')} | {_num(a['requests_per_s'])} |"
        )
    return "\n".join(lines)


CONDITION_KEYS = (
    "gpu",
    "model",
    "weights",
    "tokenizer",
    "frames_per_request",
    "protocol",
    "task_type",
    "git_revision",
    "date",
    "host",
)


def markdown_report(result: dict[str, Any]) -> str:
    """Conditions first (every number is meaningless without them), then the table."""
    c = result["conditions"]
    lines = ["# TTS streaming benchmark", ""]
    lines += [f"- {key}: {c.get(key, 'unknown')}" for key in CONDITION_KEYS]
    lines += ["", markdown_table(result["levels"]), ""]
    lines += [f"- {line}" for line in gap_free_lines(result["levels"])] + [""]
    refusals = {
        load_label(lv): lv["aggregates"]["refusals"]
        for lv in result["levels"]
        if lv["aggregates"].get("refusals")
    }
    if refusals:
        lines += ["Refused by status: " + "; ".join(f"{k}: {v}" for k, v in refusals.items()), ""]
    errors = {
        load_label(lv): lv["aggregates"]["errors"] for lv in result["levels"] if lv["aggregates"]["errors"]
    }
    if errors:
        lines += [
            "Errors by status (refusals apart): " + "; ".join(f"{k}: {v}" for k, v in errors.items()),
            "",
        ]
    aborted = {load_label(lv): lv["aborted"] for lv in result["levels"] if lv["aborted"]}
    if aborted:
        lines += [
            "Aborted by the time limit (not counted): " + ", ".join(f"{k}: {v}" for k, v in aborted.items()),
            "",
        ]
    return "\n".join(lines)


def _ok_values(level: dict[str, Any], name: str) -> np.ndarray:
    values = [r[name] for r in level["records"] if r["ok"] and r[name] is not None]
    return np.asarray(values, dtype=np.float64)


def plot_latency_cdf(levels: Sequence[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (name, title, scale, unit) in zip(
        axes,
        [
            ("ttfa_s", "Time to first audio", 1000, "ms"),
            ("first_audible_s", "Time to first audible sample", 1000, "ms"),
            ("e2e_s", "End-to-end time", 1, "s"),
        ],
        strict=True,
    ):
        for level in levels:
            values = np.sort(_ok_values(level, name)) * scale
            if values.size:
                ax.step(
                    values, np.arange(1, values.size + 1) / values.size, where="post", label=load_label(level)
                )
        ax.set(title=title, xlabel=unit, ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def plot_underrun_per_request(levels: Sequence[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    for level in levels:
        ok = [r for r in level["records"] if r["ok"] and r["max_underrun_s"] is not None]
        ax.plot(
            [r["index"] for r in ok], [r["max_underrun_s"] * 1000 for r in ok], ".", label=load_label(level)
        )
    ax.axhline(UNDERRUN_SLO_MS, color="red", linestyle="--", linewidth=1, label=f"SLO {UNDERRUN_SLO_MS:g} ms")
    ax.set(title="Max underrun per request (0 = no gap)", xlabel="request index", ylabel="max underrun (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def plot_against_load(levels: Sequence[dict[str, Any]], path: Path) -> None:
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    ax_ttfa, ax_under = fig.subplots(1, 2)
    xlabels, xs = [], []
    for mode, xlabel in (("closed", "concurrency"), ("open", "arrival rate (req/s)")):
        group = [lv for lv in levels if lv["mode"] == mode]
        if not group:
            continue
        x = [lv["concurrency"] if mode == "closed" else lv["rate"] for lv in group]
        xlabels.append(xlabel)
        xs += x
        for ax, name in ((ax_ttfa, "ttfa_s"), (ax_under, "max_underrun_s")):
            for q in ("p50", "p95", "p99"):
                y = [lv["aggregates"][name][q] for lv in group]
                ax.plot(x, [np.nan if v is None else v * 1000 for v in y], "o-", label=f"{mode} {q}")
    ax_ttfa.set(title="TTFA against load", ylabel="ms")
    ax_under.set(title="Max underrun against load", ylabel="ms")
    for ax in (ax_ttfa, ax_under):
        ax.set_xlabel(" / ".join(xlabels))
        # Sweeps double the load per level (1, 8, 32, 64, ...): a log axis spaces them evenly.
        if xs and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def write_report(result: dict[str, Any], out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Write results.json, results.md and (unless `plots=False`) the PNG plots; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / JSON_NAME, "markdown": out / MARKDOWN_NAME}
    result = {**result, "highest_gap_free_load": highest_gap_free_load(result["levels"])}
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths["markdown"].write_text(markdown_report(result))
    if plots:
        levels = result["levels"]
        for name, plot in zip(
            PLOT_NAMES, (plot_latency_cdf, plot_underrun_per_request, plot_against_load), strict=True
        ):
            paths[name] = out / name
            plot(levels, paths[name])
    return paths


# ------------------------------------------------------------------ the headline plot (BENCHMARKS.md)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEADLINE_PLOT = Path(__file__).resolve().parent / "headline.svg"
# The recorded runs behind the headline table: (file in benchmarks/results/, label, style). A run
# marked "inconclusive" is drawn in grey. The 0552569 files say git_revision b0826f4: the device
# copy's git metadata was stale (BENCHMARKS.md, benchmarks/HISTORY.md).
HEADLINE_RUNS: tuple[tuple[str, str, str], ...] = (
    ("2026-12-01-h200-stack-sweep-97ae600-closed-mps1.json.gz", "97ae600, 2026-12-01", "headline"),
    ("2026-12-01-h200-stack-sweep-97ae600-open-loop-mps1.json.gz", "97ae600, 2026-12-01, run 1", "headline"),
    (
        "2026-12-01-h200-stack-sweep-97ae600-open-loop-mps1-run2.json.gz",
        "97ae600, 2026-12-01, run 2",
        "headline",
    ),
    (
        "2026-12-02-h200-stack-sweep-0552569-decoder-share-closed.json.gz",
        "0552569 (inconclusive)",
        "inconclusive",
    ),
    (
        "2026-12-02-h200-stack-sweep-0552569-decoder-share-open.json.gz",
        "0552569 (inconclusive)",
        "inconclusive",
    ),
    (
        "2026-12-02-h200-stack-sweep-0552569-no-decoder-share-closed-mps1.json.gz",
        "0552569, no decoder share (inconclusive)",
        "inconclusive",
    ),
)
# Published p95 first audio (ms) against Poisson arrivals (req/s) on one H100, Nari Labs' harness,
# as quoted in issue #26; no SGLang-Omni figure is recorded in this repository.
PEER_P95_FIRST_AUDIO_MS = {
    "Nari Labs engine (H100, published)": {1.0: 26.5, 8.0: 33.1, 20.0: 77.2},
    "vLLM-Omni (H100, published)": {1.0: 56.8, 8.0: 117.9, 20.0: 396.9},
}
# The open-loop goals of issue #26: p95 first audio at 1, 20 and 100 req/s.
GOAL_P95_FIRST_AUDIO_MS = {1.0: 25.0, 20.0: 50.0, 100.0: 100.0}


def load_result(path: str | Path) -> dict[str, Any]:
    """A recorded results.json, plain or gzipped."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def headline_points(results_dir: str | Path = RESULTS_DIR) -> list[dict[str, Any]]:
    """One point per level of every run in `HEADLINE_RUNS`: its run label and style, mode, load,
    first audio p50/p95 (ms, successful requests), zero-underrun share of the successful requests
    and success rate (fractions)."""
    points = []
    for name, label, style in HEADLINE_RUNS:
        for level in load_result(Path(results_dir) / name)["levels"]:
            agg = level["aggregates"]
            points.append(
                {
                    "run": label,
                    "style": style,
                    "mode": level["mode"],
                    "load": level["concurrency"] if level["mode"] == "closed" else level["rate"],
                    "ttfa_p50_ms": agg["ttfa_s"]["p50"] * 1000,
                    "ttfa_p95_ms": agg["ttfa_s"]["p95"] * 1000,
                    "zero_underrun_share": agg["zero_underrun_share"],
                    "success_rate": agg["success_rate"],
                }
            )
    return points


def plot_headline(points: Sequence[dict[str, Any]], path: str | Path) -> None:
    """First audio (top) and the gap-free share of admitted streams (bottom) against load, closed
    loop (left) and open loop (right); the peers' published p95 and the goals beside the open loop.
    SVG with text kept as text and a fixed hash salt, so the same points give the same bytes."""
    with matplotlib.rc_context({"svg.hashsalt": "qtts-headline", "svg.fonttype": "none"}):
        fig = Figure(figsize=(11, 6.5), layout="constrained")
        axes = fig.subplots(2, 2, sharex="col")
        for col, (mode, xlabel) in enumerate(
            (
                ("closed", "concurrent streams (closed loop, 10 s requests)"),
                ("open", "arrivals per second (open loop, 2-20 s)"),
            )
        ):
            ax_ttfa, ax_gap = axes[0][col], axes[1][col]
            runs = dict.fromkeys(p["run"] for p in points if p["mode"] == mode)
            colors = iter(f"C{i}" for i in range(10))
            greys = iter(("0.55", "0.75", "0.85"))
            for run in runs:
                group = sorted(
                    (p for p in points if p["mode"] == mode and p["run"] == run), key=lambda p: p["load"]
                )
                x = [p["load"] for p in group]
                color = next(greys) if group[0]["style"] == "inconclusive" else next(colors)
                ax_ttfa.plot(x, [p["ttfa_p50_ms"] for p in group], "o-", color=color, label=run)
                ax_ttfa.plot(x, [p["ttfa_p95_ms"] for p in group], "s--", color=color)
                ax_gap.plot(x, [100 * p["zero_underrun_share"] for p in group], "o-", color=color, label=run)
            if mode == "open":
                for (peer, figures), marker in zip(PEER_P95_FIRST_AUDIO_MS.items(), ("x", "+"), strict=True):
                    ax_ttfa.plot(
                        list(figures),
                        list(figures.values()),
                        marker,
                        color="k",
                        markersize=9,
                        label=f"{peer}, p95",
                    )
                ax_ttfa.plot(
                    list(GOAL_P95_FIRST_AUDIO_MS),
                    list(GOAL_P95_FIRST_AUDIO_MS.values()),
                    "_",
                    color="red",
                    markersize=16,
                    markeredgewidth=2,
                    label="goal, p95",
                )
            ax_ttfa.set(title=f"First audio, {mode} loop (p50 solid, p95 dashed)", ylabel="ms", yscale="log")
            ax_ttfa.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax_ttfa.yaxis.set_major_formatter(ScalarFormatter())
            ax_ttfa.yaxis.set_minor_formatter(NullFormatter())
            ax_gap.set(
                title=f"Admitted streams without a gap, {mode} loop", ylabel="%", xlabel=xlabel, ylim=(0, 105)
            )
            ax_gap.axhline(100, color="red", linewidth=1, linestyle=":", label="goal: 100%")
            for ax in (ax_ttfa, ax_gap):
                ax.grid(alpha=0.3)
                ax.legend(fontsize="x-small")
        fig.suptitle(
            "One H200, 1.7B Base voice clone, random bf16 weights (benchmarks/results/)", fontsize="medium"
        )
        fig.savefig(path, format="svg", metadata={"Date": None})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    headline = sub.add_parser("headline", help="draw BENCHMARKS.md's plot from the recorded runs")
    headline.add_argument("--results", default=str(RESULTS_DIR), help="folder of the recorded results")
    headline.add_argument("--out", default=str(HEADLINE_PLOT), help="SVG to write")
    args = parser.parse_args(argv)
    plot_headline(headline_points(args.results), args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
