"""The paced stand-in talker of benchmarks/relay_capacity.py: its schedule, and one run through
the real gateway."""

import json

import pytest

from benchmarks.relay_capacity import FRAME_S, chunk_times, main
from qtts.streams.chunk_plan import ChunkPlan

# The plan these schedules were worked out for (the default before its one-frame start).
FOUR_FRAME_START = ChunkPlan(4, (4, 4, 8, 8, 16))


def test_chunks_come_fast_until_the_lead_then_in_real_time():
    times = chunk_times(125, FOUR_FRAME_START, first_audio_s=0.05, speedup=4.0, lead_s=4.0)
    assert [n for _, _, n in times][:6] == [4, 4, 4, 8, 8, 16]
    assert sum(n for _, _, n in times) == 125
    assert [first for _, first, _ in times][:3] == [0, 4, 8]
    t_first = times[0][0]
    assert t_first == 0.05
    for t, first, n in times[1:]:
        # never late for a listener who started at the first chunk...
        assert t <= t_first + first * FRAME_S + 1e-9
        # ...and never more than the lead ahead of it
        assert t >= t_first + (first + n) * FRAME_S - 4.0 - 1e-9
    # 4x real time early on: frames 5-8 come 4 x 20 ms after the first chunk
    assert times[1][0] == pytest.approx(0.05 + 4 * FRAME_S / 4)
    with pytest.raises(ValueError, match="shorter than a 16-frame chunk"):
        chunk_times(125, FOUR_FRAME_START, first_audio_s=0.05, speedup=4.0, lead_s=1.0)


def test_a_run_through_the_real_gateway_is_gap_free(tmp_path):
    rc = main(
        ["run", "--out", str(tmp_path), "--frames", "20", "--lead-s", "1.0", "--",
         "--concurrency", "2", "--num-requests", "4", "--warmup", "0", "--no-plots"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (level,) = data["levels"]
    assert level["aggregates"]["num_ok"] == 4 and level["aggregates"]["zero_underrun_share"] == 1.0
    metrics = (tmp_path / "metrics-gateway.txt").read_text()
    assert "tts_gateway_underruns_total 0.0" in metrics
    assert "tts_gateway_deadline_slack_seconds_count" in metrics
