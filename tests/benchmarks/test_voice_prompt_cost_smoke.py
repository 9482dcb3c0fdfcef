"""CPU smoke run of benchmarks/voice_prompt_cost.py on the tiny Base model: the clip alone and a
burst of new voices through the resolver and its worker process. No timing is asserted."""

from __future__ import annotations

import json

from benchmarks import voice_prompt_cost


def test_voice_prompt_cost_smoke(tmp_path):
    from qtts.tiny_model import build_tiny_snapshot

    model = build_tiny_snapshot(tmp_path / "base", "base")
    out = tmp_path / "voice.json"
    args = ["--device", "cpu", "--model", str(model), "--seconds", "1", "--clips", "1", "--burst", "1,3"]
    assert voice_prompt_cost.main([*args, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["median_ms"]) == {"whole_ms", "speaker_ms", "codec_ms"} and len(data["rows"]) == 1
    assert [row["voices"] for row in data["bursts"]] == [1, 3]
    for row in data["bursts"]:
        # Every voice was computed (cold), in at most one batch per voice, none larger than the burst.
        assert 1 <= row["batches"] <= row["voices"] and 1 <= row["largest_batch"] <= row["voices"]
        assert row["lengths"] == "equal" and row["voice_ms_max"] <= row["all_prompts_ms"]
        assert row["compute_ms_mean"] > 0 and row["queue_wait_ms_mean"] >= 0
