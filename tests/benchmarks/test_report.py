"""The report writer produces JSON, Markdown and PNG files with the expected content."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.loadgen import LevelRun
from benchmarks.metrics import build_record
from benchmarks.report import (
    HEADLINE_PLOT,
    PLOT_NAMES,
    TABLE_HEADER,
    headline_points,
    level_result,
    markdown_report,
    markdown_table,
    write_report,
)
from benchmarks.report import main as report_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(n: int, *, stall_every: int = 0, fail_every: int = 0) -> LevelRun:
    records = []
    for i in range(n):
        stalled = stall_every and i % stall_every == 0
        failed = fail_every and i % fail_every == 0
        times = [0.05 + 0.001 * i, 0.1, 0.9 if stalled else 0.2]
        records.append(
            build_record(
                index=i,
                prompt_index=i % 3,
                start_s=0.01 * i,
                chunk_times_s=times,
                chunk_bytes=[4800, 9600, 9600],
                e2e_s=1.0,
                ok=not failed,
                status="500" if failed else "200",
                error="boom" if failed else None,
                first_audible_s=times[0],
            )
        )
    return LevelRun(records=records, wall_s=2.0)


def _result() -> dict:
    return {
        "conditions": {
            "gpu": "NVIDIA H200",
            "model": "qwen3-tts-12hz-1.7b-base",
            "weights": "dummy",
            "git_revision": "abc",
        },
        "levels": [
            level_result("closed", _run(10), concurrency=1),
            level_result("closed", _run(20, stall_every=4, fail_every=5), concurrency=8),
            level_result("open", _run(5), rate=2.5),
        ],
    }


def test_write_report_files_and_json_keys(tmp_path):
    paths = write_report(_result(), tmp_path / "out")
    assert set(paths) == {"json", "markdown", *PLOT_NAMES}
    data = json.loads(paths["json"].read_text())
    assert set(data) == {"conditions", "levels", "highest_gap_free_load"}
    assert data["highest_gap_free_load"]["closed"]["highest"] == 1  # c=8 has stalls and failures
    assert data["highest_gap_free_load"]["open"]["highest"] == 2.5
    assert data["conditions"]["weights"] == "dummy"
    level = data["levels"][1]
    assert {
        "mode",
        "concurrency",
        "rate",
        "wall_s",
        "aborted",
        "hit_deadline",
        "gap_free",
        "aggregates",
        "records",
    } <= set(level)
    agg = level["aggregates"]
    for name in ("ttfa_s", "first_audible_s", "e2e_s", "rtf", "max_underrun_s"):
        assert {"p50", "p90", "p95", "p99"} <= set(agg[name])
    for key in ("xrt", "success_rate", "zero_underrun_share", "requests_per_s", "errors"):
        assert key in agg
    assert agg["num_requests"] == 20 and agg["num_failed"] == 4
    assert agg["errors"] == {"500": 4}
    record = level["records"][0]
    assert record["chunk_bytes"] == [4800, 9600, 9600] and len(record["chunk_times_s"]) == 3
    assert {"ttfa_s", "first_audible_s", "e2e_s", "rtf", "max_underrun_s", "ok", "status", "start_s"} <= set(
        record
    )
    for name in PLOT_NAMES:
        assert paths[name].read_bytes()[:8] == PNG_MAGIC
        assert paths[name].stat().st_size > 5000  # an actual plot, not an empty canvas


def test_markdown_table_has_one_row_per_level():
    result = _result()
    table = markdown_table(result["levels"])
    lines = table.splitlines()
    assert lines[0] == TABLE_HEADER
    assert len(lines) == 2 + 3
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "| c=1 |" in lines[2] and "| c=8 |" in lines[3] and "| 2.5 req/s |" in lines[4]
    assert "| 80.0% |" in lines[3]  # success rate of the level with failures
    text = markdown_report(result)
    assert "NVIDIA H200" in text and "weights: dummy" in text and "500" in text


def test_report_of_a_level_where_everything_failed(tmp_path):
    run = _run(3, fail_every=1)
    result = {"conditions": {}, "levels": [level_result("closed", run, concurrency=2)]}
    paths = write_report(result, tmp_path)
    row = markdown_table(result["levels"]).splitlines()[2]
    assert "| 0.0% |" in row and "| - |" in row
    assert paths["latency_cdf.png"].exists()
    assert write_report(result, tmp_path / "np", plots=False).keys() == {"json", "markdown"}


# ------------------------------------------------------------------ the headline (BENCHMARKS.md)

ROOT = Path(__file__).resolve().parents[2]


def test_the_headline_points_are_the_recorded_runs_figures():
    points = {(p["run"], p["mode"], p["load"]): p for p in headline_points()}
    # The 97ae600 closed loop, as BENCHMARKS.md's headline table gives it.
    c512, c768 = (
        points[("97ae600, 2026-12-01", "closed", 512)],
        points[("97ae600, 2026-12-01", "closed", 768)],
    )
    assert c512["success_rate"] == 1.0 and c512["zero_underrun_share"] == 1.0
    assert round(c512["ttfa_p50_ms"]) == 1674
    assert (
        round(100 * c768["success_rate"], 1) == 99.3 and round(100 * c768["zero_underrun_share"], 1) == 96.7
    )
    # The open loop: p95 first audio at 20 and 80 req/s in both runs, and no gap at any rate.
    p95 = {(run, load): round(p["ttfa_p95_ms"]) for (run, mode, load), p in points.items() if mode == "open"}
    assert (
        p95[("97ae600, 2026-12-01, run 1", 20.0)] == 122 and p95[("97ae600, 2026-12-01, run 2", 20.0)] == 120
    )
    assert (
        p95[("97ae600, 2026-12-01, run 1", 80.0)] == 226 and p95[("97ae600, 2026-12-01, run 2", 80.0)] == 259
    )
    headline_open = [p for p in points.values() if p["mode"] == "open" and p["style"] == "headline"]
    assert len(headline_open) == 7 and all(p["zero_underrun_share"] == 1.0 for p in headline_open)
    # The inconclusive session is there, marked as such.
    assert {p["style"] for p in points.values() if p["run"].startswith("0552569")} == {"inconclusive"}


def test_report_draws_the_committed_headline_plot_from_the_recorded_json(tmp_path, capsys):
    out = tmp_path / "headline.svg"
    assert report_main(["headline", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    svg = out.read_text(encoding="utf-8")
    assert svg.startswith("<?xml") and "<svg" in svg
    for text in (
        "97ae600, 2026-12-01, run 2",
        "0552569 (inconclusive)",
        "Nari Labs engine (H100, published)",
    ):
        assert text in svg
    assert out.read_bytes() == HEADLINE_PLOT.read_bytes(), (
        "benchmarks/headline.svg differs from what the recorded runs give: python -m benchmarks.report headline"
    )


def test_a_missing_recorded_run_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="97ae600-closed-mps1"):
        report_main(["headline", "--results", str(tmp_path), "--out", str(tmp_path / "x.svg")])


def test_benchmarks_md_shows_the_plot_and_its_links_resolve():
    for page in (ROOT / "BENCHMARKS.md", ROOT / "benchmarks" / "HISTORY.md"):
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name}: link to {target} does not resolve"
    first_screen = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").split("## Method", 1)[0]
    assert "](benchmarks/headline.svg)" in first_screen
    assert (
        "| load | measured | goal | best peer, same kind of load | revision, date | command |" in first_screen
    )
