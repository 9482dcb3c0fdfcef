"""CPU smoke run of benchmarks/fp8_fidelity.py (`--device cpu --tiny`): four engines on the same
weights, every pair compared per batch, JSON written. The tiny model's near-flat random logits make
its greedy codes fragile, so only the report's shape and the logit error's scale are checked."""

from __future__ import annotations

import json

from benchmarks import fp8_fidelity


def test_fp8_fidelity_smoke(tmp_path):
    out = tmp_path / "fp8.json"
    res = fp8_fidelity.main(["--device", "cpu", "--tiny", "--batches", "1,3", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    pairs = {(r["batch"], r["engine"], r["against"]) for r in data["rows"]}
    assert pairs == {(b, e, a) for b in (1, 3) for e, a in fp8_fidelity.PAIRS}
    for r in data["rows"]:
        for key in ("frame0_rows_equal", "frame0_c0_equal", "codes_equal"):
            assert 0.0 <= r[key] <= 1.0
        assert 0.0 < r["logit_rel_err"] < 0.2
    # One linear alone: e4m3 rounds ~10x coarser than bf16 (3 mantissa bits against 7).
    single = data["single_linear_rel_err"]
    assert set(single) == {
        f"{p}.{w}" for p in ("talker", "predictor") for w in ("w_qkv", "w_o", "w_gate_up", "w_down")
    }
    for v in single.values():
        assert 0 < v["bf16"] < 0.01 and 4 * v["bf16"] < v["fp8"] < 0.08
