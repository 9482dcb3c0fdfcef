"""Snapshot discovery and validation, shipped full-size configs, dummy loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from qtts.model import SnapshotError, load_talker_bundle
from qtts.model.bundle import build_modules
from qtts.model.config import ModelConfig
from qtts.model.snapshot import CONFIGS_DIR, open_snapshot, shipped_configs

VARIANTS = [
    f"qwen3-tts-12hz-{s}-{v}" for s in ("0.6b", "1.7b") for v in ("base", "customvoice", "voicedesign")
]


def test_not_a_snapshot_folder(tmp_path):
    with pytest.raises(SnapshotError, match="no config.json"):
        load_talker_bundle(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SnapshotError, match="not a Qwen3-TTS snapshot.*llama"):
        load_talker_bundle(tmp_path)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(SnapshotError, match="no such folder"):
        load_talker_bundle(tmp_path / "nope")
    with pytest.raises(SnapshotError, match="shipped configs"):
        load_talker_bundle("no-such-config", load_format="dummy")


def test_variant_mismatch(tiny_snapshot_factory):
    folder = tiny_snapshot_factory("custom_voice")
    with pytest.raises(SnapshotError, match="'custom_voice' model but 'base' was expected"):
        load_talker_bundle(folder, expect_model_type="base")
    assert isinstance(SnapshotError("x"), ValueError)


def test_incomplete_snapshot(tiny_snapshot_factory, tmp_path):
    src = tiny_snapshot_factory("voice_design")
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    with pytest.raises(SnapshotError, match="missing model.safetensors"):
        open_snapshot(dst)


def test_weights_that_do_not_match_the_config(tiny_snapshot_factory, tmp_path):
    src = tiny_snapshot_factory("voice_design")
    dst = tmp_path / "mismatch"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["talker_config"]["num_hidden_layers"] = 3
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SnapshotError, match="talker weights do not match.*missing"):
        load_talker_bundle(dst)


def test_bundle_info(tiny_snapshot_factory):
    bundle = load_talker_bundle(tiny_snapshot_factory("custom_voice"), expect_model_type="custom_voice")
    info = bundle.info
    assert info.model_type == "custom_voice"
    assert info.name == "qwen3-tts-tiny-custom_voice"
    assert info.speakers["vivian"] == 3065 and info.speakers["dylan"] == 2878
    assert "beijing_dialect" not in info.languages and info.languages["english"] == 2050
    assert (info.num_codebooks, info.codebook_size, info.sample_rate, info.samples_per_frame) == (
        16,
        2048,
        24000,
        1920,
    )
    assert bundle.speaker_encoder is None and bundle.codec_encoder is None  # Base only
    d = bundle.generation_defaults
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.greedy) == (0.9, 50, 1.0, 1.05, False)


def test_shipped_configs():
    assert shipped_configs() == sorted(VARIANTS)
    for name in VARIANTS:
        cfg = ModelConfig.from_file(CONFIGS_DIR / name / "config.json")
        size, variant = name.split("-")[3:5]
        assert (
            cfg.tts_model_type
            == {"base": "base", "customvoice": "custom_voice", "voicedesign": "voice_design"}[variant]
        )
        t = cfg.talker
        assert (t.decoder.num_layers, t.decoder.num_heads, t.decoder.num_kv_heads, t.decoder.head_dim) == (
            28,
            16,
            8,
            128,
        )
        assert t.decoder.hidden_size == (1024 if size == "0.6b" else 2048)
        assert t.decoder.intermediate_size == (3072 if size == "0.6b" else 6144)
        assert (t.vocab_size, t.text_vocab_size, t.text_hidden_size) == (3072, 151936, 2048)
        p = t.predictor.decoder
        assert (p.num_layers, p.hidden_size, p.intermediate_size, p.num_heads, p.num_kv_heads) == (
            5,
            1024,
            3072,
            16,
            8,
        )
        assert (t.codec_pad_id, t.codec_bos_id, t.codec_eos_id) == (2148, 2149, 2150)
        assert (cfg.tts_pad_id, cfg.tts_bos_id, cfg.tts_eos_id) == (151671, 151672, 151673)
        assert t.suppressed_ids[0] == 2048 and 2150 not in t.suppressed_ids and len(t.suppressed_ids) == 1023
        if variant == "customvoice":
            assert t.speaker_ids["vivian"] == 3065 and t.speaker_dialects["eric"] == "sichuan_dialect"
        if variant == "base":
            assert cfg.speaker_encoder["enc_dim"] == t.decoder.hidden_size
        assert cfg.supports_instruct == (variant != "customvoice" or size == "1.7b")


@pytest.mark.parametrize("name", ["qwen3-tts-12hz-1.7b-base", "qwen3-tts-12hz-0.6b-customvoice"])
def test_full_size_module_tree_on_meta(name):
    """The full-size module tree builds (on `meta`: no memory) with the expected parameter count."""
    cfg = ModelConfig.from_file(CONFIGS_DIR / name / "config.json")
    talker, predictor = build_modules(cfg)
    t, p = cfg.talker, cfg.talker.predictor
    h, th = t.decoder.hidden_size, t.text_hidden_size
    expected_talker = (
        t.decoder.num_parameters()
        + t.vocab_size * h
        + t.text_vocab_size * th  # codec + text embeddings
        + th * th
        + th
        + th * h
        + h  # text projection
        + h * t.vocab_size  # codec head
    )
    ph = p.decoder.hidden_size
    steps = p.num_code_groups - 1
    expected_predictor = p.decoder.num_parameters() + steps * (p.vocab_size * h + ph * p.vocab_size)
    if ph != h:
        expected_predictor += h * ph + ph
    assert sum(x.numel() for x in talker.parameters()) == expected_talker
    assert sum(x.numel() for x in predictor.parameters()) == expected_predictor
    if name.startswith("qwen3-tts-12hz-1.7b"):
        assert 1.8e9 < expected_talker + expected_predictor < 2.0e9
    names = {f"talker.{k}" for k in talker.state_dict()} | {
        f"talker.code_predictor.{k}" for k in predictor.state_dict()
    }
    assert "talker.model.layers.27.self_attn.q_norm.weight" in names
    assert "talker.code_predictor.lm_head.14.weight" in names
    assert "talker.code_predictor.model.codec_embedding.14.weight" in names
    assert ("talker.code_predictor.small_to_mtp_projection.weight" in names) == (ph != h)


def test_dummy_load_of_a_tiny_config_is_seeded(tiny_snapshot_factory):
    folder = tiny_snapshot_factory("voice_design")
    a = load_talker_bundle(folder, load_format="dummy", seed=3)
    b = load_talker_bundle(folder, load_format="dummy", seed=3)
    c = load_talker_bundle(folder, load_format="dummy", seed=4)
    wa, wb, wc = (x.talker.codec_head.weight for x in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.isfinite(a.talker.model.layers[0].self_attn.q_proj.weight).all()
    assert a.snapshot.load_format == "dummy"


def test_shipped_config_name_resolves_for_dummy_only():
    snap = open_snapshot("qwen3-tts-12hz-1.7b-base", load_format="dummy", expect_model_type="base")
    assert snap.folder == CONFIGS_DIR / "qwen3-tts-12hz-1.7b-base"
    assert snap.name == "qwen3-tts-12hz-1.7b-base" and snap.load_format == "dummy"
    assert snap.speech_tokenizer_dir == CONFIGS_DIR / "speech_tokenizer"
    assert not snap.has_tokenizer  # dummy loads assemble one (Qwen's BPE, else the tiny test tokenizer)
    with pytest.raises(SnapshotError, match="no such folder"):
        open_snapshot("qwen3-tts-12hz-1.7b-base")


def test_hub_download_failure_is_a_snapshot_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        SnapshotError, match="Qwen/Qwen3-TTS-12Hz-1.7B-Base: no such local folder and the hub download failed"
    ):
        load_talker_bundle("Qwen/Qwen3-TTS-12Hz-1.7B-Base")


def test_tiny_snapshot_builds_without_qwen_tts_and_is_deterministic(tiny_snapshot_factory, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "again"
    code = (
        "import sys; sys.modules['qwen_tts'] = None\n"  # any import of qwen_tts fails
        "from qtts.tiny_model import build_tiny_snapshot\n"
        f"build_tiny_snapshot({str(out)!r}, 'base', seed=0)\n"
    )
    root = Path(__file__).resolve().parents[3]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=600)
    first = tiny_snapshot_factory("base")
    for name in (
        "config.json",
        "generation_config.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "model.safetensors",
    ):
        assert (out / name).read_bytes() == (first / name).read_bytes(), name
    assert (out / "speech_tokenizer" / "config.json").is_file()


def test_voice_encoder_fingerprint_follows_the_encoder_weights(tiny_snapshot_factory, tmp_path):
    """Voice-prompt cache keys use this digest: equal encoders (the same snapshot loaded twice,
    or a copy under another name) share it; a changed speaker-encoder weight changes it; models
    without encoders have none."""
    snap = tiny_snapshot_factory("base")
    a = load_talker_bundle(snap)
    b = load_talker_bundle(shutil.copytree(snap, tmp_path / "renamed-base"))
    assert b.info.name != a.info.name
    fp = a.voice_encoder_fingerprint()
    assert len(fp) == 64 and fp == b.voice_encoder_fingerprint()
    with torch.no_grad():
        next(iter(b.speaker_encoder.parameters())).view(-1)[0] += 1.0
    b._voice_fingerprint = None  # computed once per bundle; recompute after the change
    assert b.voice_encoder_fingerprint() != fp
    assert load_talker_bundle(tiny_snapshot_factory("custom_voice")).voice_encoder_fingerprint() == ""
