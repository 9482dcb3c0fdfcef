"""Opening forced-aligner snapshots: the shipped full-size config, the tiny one, and refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qtts.model.aligner import SHIPPED_CONFIG, UnsupportedLanguage, open_aligner_snapshot, split_words
from qtts.model.aligner.network import AlignerNet, encoder_output_length
from qtts.model.snapshot import SnapshotError


def test_the_shipped_config_is_the_0_6b_aligner():
    snap = open_aligner_snapshot(SHIPPED_CONFIG, load_format="dummy")
    cfg = snap.config
    assert (cfg.classify_num, cfg.timestamp_token_id, cfg.timestamp_segment_ms) == (5000, 151705, 80.0)
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.audio.encoder_layers) == (1024, 28, 24)
    with torch.device("meta"):
        net = AlignerNet(cfg)
    params = sum(p.numel() for p in net.parameters())
    # "0.6B" names the Qwen3-0.6B decoder; with the 24-layer audio encoder the checkpoint holds 0.92B.
    assert 0.9e9 < params < 0.95e9, params


def test_a_tts_snapshot_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}), encoding="utf-8")
    with pytest.raises(SnapshotError, match="not a Qwen3-ForcedAligner snapshot"):
        open_aligner_snapshot(tmp_path)


def test_missing_weights_are_named(tiny_aligner_dir, tmp_path):
    for name in ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_aligner_dir / name).read_bytes())
    with pytest.raises(SnapshotError, match="missing model.safetensors"):
        open_aligner_snapshot(tmp_path)


def test_an_unknown_name_lists_the_shipped_config():
    with pytest.raises(SnapshotError, match=SHIPPED_CONFIG):
        open_aligner_snapshot("no-such-aligner", load_format="dummy")


def test_korean_is_refused_rather_than_split_differently():
    with pytest.raises(UnsupportedLanguage, match="Korean"):
        split_words("안녕하세요 세계", "Korean")


def test_encoder_output_length_counts_80ms_per_embedding():
    assert [encoder_output_length(n) for n in (1, 8, 100, 250, 1000)] == [1, 1, 13, 13 + 13 + 7, 130]


def test_prepare_refuses_text_without_words_and_empty_audio(tiny_aligner):
    with pytest.raises(ValueError, match="no word"):
        tiny_aligner.prepare(np.zeros(24000, np.float32), 24000, " ... !? ", "English")
    with pytest.raises(ValueError, match="too short"):
        tiny_aligner.prepare(np.zeros(100, np.float32), 24000, "hello", "English")
