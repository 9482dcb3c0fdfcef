"""CPU smoke runs of the GPU benchmark scripts (`--device cpu --tiny`): they run end to end and write
the JSON the results tables are made from. No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import official_baseline, prefix_kv_transfer, talker_capacity


def test_talker_capacity_smoke(tmp_path):
    out = tmp_path / "capacity.json"
    res = talker_capacity.main(["--device", "cpu", "--tiny", "--keep-going", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    settings, levels = data["settings"], data["levels"]
    assert settings["streams"] == [2, 4] and [lv["streams"] for lv in levels] == [2, 4]
    assert data["meta"]["num_slots"] == 4 and data["budget_ms"] == 80.0
    assert settings["prompt_len"] + settings["frames_per_request"] <= data["meta"]["max_len"]
    for lv in levels:
        n = lv["streams"]
        assert lv["measured_steps"] == settings["measure_steps"] == 12
        assert 0 < lv["running_per_step_mean"] <= n
        # Every output of a fixed-length request carries codes: frames = rows decoded.
        assert lv["frames"] == round(lv["running_per_step_mean"] * lv["measured_steps"])
        # A finished request is replaced at once, and 12 steps outlive 6-frame requests.
        assert lv["arrivals"] == lv["finished"] > 0 and lv["prefill_positions_per_step_mean"] > 0
        assert lv["num_intervals"] > 0
        # Without the prefix cache every prompt is prefilled whole, once: all but its last position.
        assert lv["prompts_completed_per_step"] > 0 and lv["prefill_chunks_per_step"] > 0
        assert lv["prefill_positions_per_completed_prompt"] == pytest.approx(
            settings["prompt_len"] - 1, rel=0.5
        )
        assert lv["prefilling_per_step_mean"] >= 0 and lv["waiting_per_step_mean"] >= 0
        assert 0 < lv["interval_ms_p50"] <= lv["interval_ms_p99"] <= lv["interval_ms_max"]
        assert 0 < lv["step_ms_p50"] <= lv["step_ms_p99"] <= lv["step_ms_max"]
        assert lv["p99_interval_over_median_step"] == pytest.approx(lv["interval_ms_p99"] / lv["step_ms_p50"])
        assert lv["real_time"] == (lv["interval_ms_p99"] <= data["budget_ms"])
    passing = [lv["streams"] for lv in levels if lv["real_time"]]
    assert data["max_realtime_streams"] == (max(passing) if passing else 0)


def test_capacity_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert talker_capacity.percentile(values, 50) == 50.0
    assert talker_capacity.percentile(values, 99) == 99.0
    assert talker_capacity.percentile(values, 100) == 100.0
    assert talker_capacity.percentile([7.0], 99) == 7.0


@pytest.mark.reference
def test_official_baseline_smoke(tmp_path):
    out = tmp_path / "official.json"
    res = official_baseline.main(["--device", "cpu", "--tiny", "--batches", "1,2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    assert data["meta"]["weights_match_ours"] is True and data["meta"]["model_type"] == "base"
    frames = data["settings"]["frames"]
    assert [b["batch"] for b in data["batches"]] == [1, 2]
    for b in data["batches"]:
        assert b["frames_per_request"] == [frames] * b["batch"]  # fixed length despite random weights
        assert len(b["runs"]) == data["settings"]["repeats"]
        for run in b["runs"]:
            # The reference frames are cut from the front: one frame of audio per generated frame.
            assert run["samples"] == [frames * 1920] * b["batch"] and run["sample_rate"] == 24000
        assert b["audio_s_per_request"] == pytest.approx(frames * 0.08)
        assert 0 < b["talker_generate_s"] <= b["wall_s"]
        assert b["rtf"] == pytest.approx(b["wall_s"] / b["audio_s_per_request"])
        assert b["aggregate_x_real_time"] == pytest.approx(b["batch"] / b["rtf"])


def test_random_snapshot_holds_exactly_our_dummy_weights(tmp_path):
    from qtts.model import load_talker_bundle
    from qtts.tiny_model import build_tiny_snapshot

    source = build_tiny_snapshot(tmp_path / "qwen3-tts-tiny-base", "base", seed=0)
    folder = official_baseline.write_random_snapshot(
        str(source), tmp_path / "random", seed=3, dtype=torch.float32
    )
    dummy = load_talker_bundle(source, load_format="dummy", seed=3)
    saved = load_talker_bundle(folder)  # strict: every weight present with its shape
    for part in ("talker", "code_predictor", "speaker_encoder"):
        want, got = getattr(dummy, part).state_dict(), getattr(saved, part).state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), part
    assert (folder / "speech_tokenizer" / "model.safetensors").is_file()
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )


def test_prefix_kv_transfer_smoke(tmp_path):
    """The fetch path round-trips the KV bytes through a real redis-server (the script raises if
    they differ) and every timing is recorded."""
    out = tmp_path / "prefix_kv.json"
    res = prefix_kv_transfer.main(["--device", "cpu", "--tiny", "--iters", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    rows = data["rows"]
    assert [r["positions"] for r in rows] == [8, 16]
    for r in rows:
        assert r["kv_bytes"] == r["positions"] * data["meta"]["bytes_per_position"] > 0
        for key in ("recompute_eager_ms", "gpu_cache_hit_ms", "device_to_host_ms", "bytes_to_slot_ms"):
            assert r[key] > 0
        if data["meta"]["redis"].startswith("redis-server on loopback"):
            assert r["redis_get_ms"] > 0 and r["fetch_total_ms"] > 0


def test_gil_convoy_reports_every_interval_and_restores_the_switch_interval():
    import sys

    from benchmarks import gil_convoy

    before = sys.getswitchinterval()
    rows = gil_convoy.main(["--intervals-ms", "2,0.5", "--steps", "3"])
    assert [r["interval_ms"] for r in rows] == [None, 2.0, 0.5]
    assert [r["busy_thread"] for r in rows] == [False, True, True]
    assert all(r["max_ms"] >= r["median_ms"] > 0 for r in rows)
    assert sys.getswitchinterval() == before


def test_skinny_linear_sweeps_the_real_model_shapes():
    """The tile sweep (CUDA only) covers every few-row decode matmul of the 1.7B config, and the
    frame step's rules name only shapes it swept."""
    from benchmarks import skinny_linear
    from qtts.engine import triton_ops
    from qtts.model.config import TalkerModelConfig

    with open("configs/qwen3-tts-12hz-1.7b-base/config.json") as f:
        cfg = json.load(f)
    talker = TalkerModelConfig.from_dict(cfg["talker_config"])
    want = set()
    for d, vocab in (
        (talker.decoder, talker.vocab_size),
        (talker.predictor.decoder, talker.predictor.vocab_size),
    ):
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        want |= {
            (q + 2 * kv, d.hidden_size),
            (d.hidden_size, q),
            (2 * d.intermediate_size, d.hidden_size),
            (d.hidden_size, d.intermediate_size),
            (vocab, d.hidden_size),
        }
    want.add((talker.predictor.decoder.hidden_size, talker.decoder.hidden_size))  # the input projection
    swept = {(n, k) for _, n, k, _ in skinny_linear.SHAPES}
    assert swept == want
    assert set(triton_ops.SKINNY_RULES) <= swept


def test_prompt_build_cost_smoke(tmp_path):
    import json

    from benchmarks import prompt_build_cost
    from qtts.tiny_model import build_tiny_snapshot

    snap = build_tiny_snapshot(tmp_path / "tiny-base", "base")
    out = tmp_path / "build.json"
    assert prompt_build_cost.main(["--model", str(snap), "--builds", "3", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["builds"] == 3 and got["device"] == "cpu"
    assert [r["batch"] for r in got["rows"]] == [1, 16]
    for row in got["rows"]:
        assert row["ms_per_build_alone"] > 0 and row["ms_per_build_beside_busy_thread"] > 0
        assert row["aten_ops_per_batch"] > 0
    # Built together, a batch dispatches fewer ops than its prompts would one by one.
    assert got["rows"][1]["aten_ops_per_batch"] < 16 * got["rows"][0]["aten_ops_per_batch"]
    assert got["profiled_own_ms_per_build"] and all(r["ms"] >= 0 for r in got["profiled_own_ms_per_build"])
