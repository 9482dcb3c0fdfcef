"""`benchmarks.refusal_latency burst` on this machine: the real gateway in front of a stand-in talker
with room for half of a burst lets that half in and refuses the rest, and the run's JSON says so."""

from __future__ import annotations

import json

from benchmarks.refusal_latency import burst_report, main


def test_a_burst_past_the_room_is_half_refused(tmp_path):
    out = tmp_path / "burst"
    assert main(["burst", "--out", str(out), "--room", "4", "--requests", "8", "--bursts", "1",
                 "--frames", "4", "--pools", "2", "--pause-s", "0"]) == 0  # fmt: skip
    (row,) = json.loads((out / "summary.json").read_text())["summary"]["bursts"]
    assert (row["admitted"], row["refused"], row["other"]) == (4, 4, 0)
    assert row["refused_ms"].startswith("n=4 ") and row["ttfa_ms"].startswith("n=4 ")
    (burst,) = json.loads((out / "bursts.json").read_text())["bursts"]
    refused = [r for r in burst["records"] if r["status"] == "429"]
    assert all(0 < r["e2e_s"] < 30 and r["ttfa_s"] is None for r in refused)


def test_the_report_counts_each_burst_apart():
    def rec(status, e2e, ttfa=None):
        return {"status": status, "e2e_s": e2e, "ttfa_s": ttfa, "sent_s": 0.0}

    bursts = [
        {"wall_s": 1.0, "records": [rec("429", 0.05), rec("429", 0.07), rec("200", 2.0, 0.1)]},
        {"wall_s": 1.0, "records": [rec("200", 2.0, 0.2), rec("TRANSPORT", 0.3)]},
    ]
    summary = burst_report(bursts, [0.5, 0.25])
    first, second = summary["bursts"]
    assert (first["admitted"], first["refused"], first["other"], first["gateway_cpu_s"]) == (1, 2, 0, 0.5)
    assert (second["admitted"], second["refused"], second["other"]) == (1, 0, 1)
    assert second["refused_ms"] == "n=0"
    assert summary["refused_ms_all"].startswith("n=2 p50 60 ")
