"""benchmarks/admission_timeline.py: a burst's windows from an admission trace."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import admission_timeline, stack_summary


def _plan(t, running, waiting, admitted=0, budget=None, tightest=None, reason="", capacity=900, drain=None):
    return {
        "kind": "plan", "t": t, "running": running, "waiting": waiting, "admitted": admitted, "refused": 0,
        "stepping": running, "prefill_budget": budget, "capacity": capacity, "drain_per_s": drain,
        "tightest_s": tightest, "reason": reason,
    }  # fmt: skip


ROWS = [
    _plan(0.0, 1, 0),  # the idle request before the burst
    _plan(5.00, 1, 40, admitted=0),
    {"kind": "step", "t": 5.01, "batch": 17, "prompts": 16, "prefill_positions": 4096, "seconds": 0.014},
    _plan(5.02, 17, 24, admitted=16, budget=4096, tightest=0.5, drain=300.0),
    {"kind": "room", "t": 5.03, "ahead": 0, "start_now": 100, "accept": 120, "running": 17, "waiting": 24},
    _plan(
        5.25,
        18,
        60,
        admitted=1,
        budget=320,
        tightest=0.01,
        reason="282 prompt positions wait for their prefill",
    ),
    _plan(
        5.30,
        19,
        59,
        admitted=1,
        budget=320,
        tightest=0.02,
        reason="290 prompt positions wait for their prefill",
    ),
    {"kind": "refuse", "t": 5.31, "ahead": 0, "running": 19, "waiting": 59, "predicted_wait_s": 3.4},
    {"kind": "refuse", "t": 5.32, "ahead": 2, "running": 19, "waiting": 59, "predicted_wait_s": 3.6},
    _plan(9.00, 500, 50),  # the next level's burst, long after
]


def test_each_burst_is_found_and_its_windows_add_up():
    assert admission_timeline.burst_starts(ROWS, 32) == [5.0, 9.0]
    first, second = admission_timeline.timeline(ROWS, 5.0, 0.2, 0.6)[:2]
    assert (first["started"], first["prompts"], first["steps"]) == (16, 16, 1)
    assert (first["waiting_max"], first["running"], first["room_max"], first["drain_per_s"]) == (
        40,
        17,
        120,
        300.0,
    )
    assert first["prefill_budget"] == 4096
    # The second window: one start a plan on the prefill floor, two refusals at about 3.5 s.
    assert (second["started"], second["refused"], second["refused_wait_s"]) == (2, 2, 3.5)
    assert second["prefill_budget"] == 320 and second["tightest_ms"] == 15.0
    assert second["reason"] == "N prompt positions wait for their prefill"


def test_the_report_and_the_stack_summary_show_the_trace(tmp_path):
    text = admission_timeline.report(ROWS, 32, 0.2, 1.0, "trace")
    assert text.count("burst from") == 2
    assert "| 0.2 | 19 | 60 | 2 | 2 (3.5) |" in text
    run = tmp_path / "http1"
    run.mkdir()
    with gzip.open(run / "admission-trace.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (run / "results.json").write_text(json.dumps({"levels": []}))
    summary = stack_summary.summary([tmp_path])
    assert "admission (admission-trace.jsonl.gz):" in summary
    assert "burst from t=5.000 s" in summary
    assert "no plan had" in admission_timeline.report(ROWS[:1], 32, 0.2, 1.0, "idle")


def _costly_plan(t, running, capacity):
    return {
        **_plan(t, running, 10, capacity=capacity),
        "step_base_s": 0.0055, "step_per_stream_s": 0.000038, "decoder_frame_s": 0.000025,
    }  # fmt: skip


def test_the_frame_steps_are_set_against_admission_s_model():
    """Contended steps on a shared GPU: 20 ms whatever the width plus 5 us a stream, against a model
    of 5.5 ms + 38 us a stream; 400 streams running need 5,000 frames a second."""
    rows = [_plan(0.0, 400, 40, capacity=710)]
    for i in range(30):  # 30 steps in the first second, 100 to 390 streams wide, no prefill
        b = 100 + 10 * i
        rows.append({"kind": "step", "t": 0.01 + i / 30, "batch": b, "prompts": 0, "prefill_positions": 0,
                     "seconds": 0.020 + 0.000005 * b})  # fmt: skip
        rows.append(_costly_plan(0.02 + i / 30, 400, 700 + i))
    rows.append(
        {"kind": "step", "t": 0.5, "batch": 420, "prompts": 16, "prefill_positions": 752, "seconds": 0.05}
    )
    (first,) = admission_timeline.step_costs(rows, 0.0, 1.0, 3)  # nothing after the first second
    assert first["steps"] == 30 and (first["batch_min"], first["batch_max"]) == (100, 390)
    assert first["line_base_ms"] == pytest.approx(20.0) and first["line_slope_us"] == pytest.approx(5.0)
    assert (first["model_base_ms"], first["model_slope_us"], first["decoder_us"]) == pytest.approx(
        (5.5, 38, 25)
    )
    assert (first["capacity_min"], first["capacity_max"]) == (700, 729)
    assert first["frames_per_s"] == sum(100 + 10 * i for i in range(30)) + 420
    assert first["running"] == 400 and first["needed_per_s"] == pytest.approx(5000)
    text = admission_timeline.render_costs([first])
    assert "| 0.0 | 30 (100-390) | 20.0 + 5.0 | 5.5 + 38.0, 25.0 | 700-729 | 400 | 7770 / 5000 |" in text
