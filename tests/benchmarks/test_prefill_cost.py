"""CPU smoke run of benchmarks/prefill_cost.py (`--device cpu --tiny`): it runs end to end, writes
its JSON, and the packed and per-row prefills wrote the same KV. No timing is asserted."""

from __future__ import annotations

import json

from benchmarks import prefill_cost


def test_prefill_cost_smoke(tmp_path):
    out = tmp_path / "prefill.json"
    res = prefill_cost.main(["--device", "cpu", "--tiny", "--prompts", "1,3", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    assert [r["prompts"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["positions"] == r["prompts"] * r["prompt_len"]
        assert r["kv_max_abs_diff"] < 1e-4  # float32 tiny model: the two paths agree to rounding
        for key in (
            "rows_us_per_pos",
            "packed_us_per_pos",
            "packed_eager_us_per_pos",
            "continuing_us_per_pos",
        ):
            assert r[key] > 0
