"""benchmarks/code2wav_decode.py runs end to end on CPU with the tiny decoder: both conv stacks are
measured in one run, the SNR of an fp32 variant against the fp32 reference is near-exact, and the
table and the JSON carry one row per variant."""

from __future__ import annotations

import json

from benchmarks import code2wav_decode


def test_one_run_compares_the_conv_stacks(tiny_codec_dir, tmp_path, capsys):
    out = tmp_path / "dec.json"
    argv = ["--model", str(tiny_codec_dir), "--load-format", "auto", "--device", "cpu"]
    argv += ["--streams", "2", "--chunk", "2", "--iters", "1", "--prefix-frames", "3", "--revision", "test"]
    argv += ["--precisions", "fp32", "--conv-stacks", "channels_first", "channels_last", "--out", str(out)]
    assert code2wav_decode.main(argv) == 0
    result = json.loads(out.read_text())
    keys = ["fp32_channels_first_graph", "fp32_channels_last_graph"]
    assert [r["variant"] for r in result["summary"]] == keys
    for row in result["summary"]:
        assert row["us_per_frame_2"] > 0 and row["xrt_2"] > 0 and row["first_chunk_1f_ms"] > 0
        assert row["snr_db"] > 80  # fp32 against the fp32 reference: equal up to summation order
    printed = capsys.readouterr().out
    assert "us/f@2" in printed and all(k in printed for k in keys)


def test_a_failing_variant_is_recorded_and_the_others_still_run(tiny_codec_dir, tmp_path, monkeypatch):
    real = code2wav_decode.steady_state

    def flaky(eng, *args):
        if eng.runner.conv_stack == "channels_last":
            raise RuntimeError("kernel failed to launch")
        return real(eng, *args)

    monkeypatch.setattr(code2wav_decode, "steady_state", flaky)
    out = tmp_path / "dec.json"
    argv = ["--model", str(tiny_codec_dir), "--load-format", "auto", "--device", "cpu", "--no-profile"]
    argv += ["--streams", "1", "--chunk", "1", "--iters", "1", "--prefix-frames", "2", "--revision", "test"]
    argv += ["--variants", "fp32:channels_last", "fp32:channels_first", "--out", str(out)]
    assert code2wav_decode.main(argv) == 1
    result = json.loads(out.read_text())
    assert "kernel failed" in result["errors"]["fp32_channels_last_graph"]
    assert [r["variant"] for r in result["summary"]] == ["fp32_channels_first_graph"]
