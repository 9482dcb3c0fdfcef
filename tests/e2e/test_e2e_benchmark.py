"""The benchmark client against the real local stack: every request measured, the report complete."""

from __future__ import annotations

import json

import pytest

from benchmarks.client import main as bench_main

pytestmark = pytest.mark.e2e

FRAMES = 6


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_benchmark_client_reports_every_request(stack, tmp_path, protocol):
    out = tmp_path / protocol
    rc = bench_main(
        [
            "--protocol",
            protocol,
            "--url",
            stack.http_url,
            "--grpc-target",
            stack.grpc_address,
            "--task-type",
            "voice_clone",
            "--x-vector-only",
            "--synthetic-ref-seconds",
            "1.0",
            "--concurrency",
            "1",
            "2",
            "--num-requests",
            "3",
            "--warmup",
            "0",
            "--max-new-tokens",
            str(FRAMES),
            "--fixed-length",
            "--time-limit",
            "240",
            "--out",
            str(out),
            "--no-progress",
            "--weights",
            "tiny-random",
        ]
    )
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    levels = result["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for level in levels:
        agg = level["aggregates"]
        assert agg["num_requests"] == 3 and agg["num_ok"] == 3 and agg["success_rate"] == 1.0
        assert agg["xrt"] > 0 and agg["audio_s_total"] > 0
        for key in ("ttfa_s", "e2e_s", "rtf", "max_underrun_s"):
            assert set(agg[key]) >= {"p50", "p90", "p95", "p99"}, key
        for record in level["records"]:
            assert record["ok"], record
            # --fixed-length: exactly FRAMES frames of 1920 samples, 2 bytes each.
            assert sum(record["chunk_bytes"]) == FRAMES * 1920 * 2
            assert len(record["chunk_times_s"]) == len(record["chunk_bytes"]) >= 1
            assert record["ttfa_s"] > 0 and record["e2e_s"] >= record["ttfa_s"]
    assert (out / "results.md").read_text().count("|") > 10
    for png in ("latency_cdf.png", "underrun_per_request.png", "ttfa_vs_load.png"):
        assert (out / png).stat().st_size > 1000
