"""CPU smoke run of the aligner cost benchmark (`--device cpu --tiny`): it runs end to end and
writes the JSON its BENCHMARKS.md table is made from. No timing is asserted."""

from __future__ import annotations

import json

from benchmarks import aligner_cost


def test_aligner_cost_smoke(tmp_path, capsys):
    out = tmp_path / "aligner.json"
    res = aligner_cost.main(
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tiny",
            "--batches",
            "1,3",
            "--repeats",
            "1",
            "--engines",
            "graphs,unpadded",
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    assert [(r["engine"], r["batch"]) for r in data["rows"]] == [
        ("graphs", 1),
        ("graphs", 3),
        ("unpadded", 1),
        ("unpadded", 3),
    ]
    # Every input of every batch came back with all its words aligned.
    assert [r["words_per_call"] for r in data["rows"]] == [12, 36, 12, 36]
    # On the CPU the bucketed path runs eagerly and gives the unpadded path's timestamps.
    assert data["agreement_with_unpadded"] == {
        "graphs": {"times": 72, "equal_share": 1.0, "max_diff_ms": 0.0}
    }
    assert data["seconds_per_input"] == 4.0 and data["words_per_input"] == 12
    # 4 s of audio is 52 audio tokens, plus two timestamp slots per word.
    assert data["prompt_tokens"] > 52 + 2 * 12
    assert data["gpu"] == "cpu" and data["peak_memory_gib"] is None
    printed = capsys.readouterr().out
    assert "| engine | batch | ms per call |" in printed and "\n| unpadded | 3 |" in printed
