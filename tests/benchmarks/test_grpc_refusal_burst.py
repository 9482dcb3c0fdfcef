"""`benchmarks.grpc_refusal_burst` on this machine: the real gateway in front of a stand-in talker
with no room refuses every call of a burst over gRPC, and the run says so in its JSON."""

from __future__ import annotations

import json

from benchmarks.grpc_refusal_burst import main


def test_a_burst_against_no_room_is_refused_whole(tmp_path):
    out = tmp_path / "burst"
    assert main(["--out", str(out), "--calls", "12", "--processes", "2", "--channels", "2", "--repeats", "1",
                 "--no-clip", "--start-in-s", "2"]) == 0  # fmt: skip
    (row,) = json.loads((out / "burst.json").read_text())["bursts"]
    assert row["calls"] == 12 and row["statuses"] == {"RESOURCE_EXHAUSTED": 12}
    latency = row["latency_s"]["RESOURCE_EXHAUSTED"]
    assert 0 < latency["p50"] <= latency["p99"] < 30
    assert row["gateway_cpu_s"] >= 0
