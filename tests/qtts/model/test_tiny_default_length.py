"""The tiny default snapshot's length declaration, also on a snapshot an older checkout built."""

from __future__ import annotations

import json

from qtts.model.bundle import DEFAULT_LENGTH_KEY
from qtts.tiny_model import TINY_DEFAULT_LENGTH, ensure_tiny_snapshot


def test_the_tiny_declaration_uses_the_bundle_key():
    assert set(TINY_DEFAULT_LENGTH) == {DEFAULT_LENGTH_KEY}


def test_an_old_tiny_snapshot_gets_the_default_length(tmp_path):
    snap = tmp_path / "qwen3-tts-tiny-base"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    old = {"max_new_tokens": 8192, "temperature": 0.9}
    (snap / "generation_config.json").write_text(json.dumps(old))
    assert ensure_tiny_snapshot(snap) == snap
    assert json.loads((snap / "generation_config.json").read_text()) == {**old, **TINY_DEFAULT_LENGTH}
    mtime = (snap / "generation_config.json").stat().st_mtime_ns
    ensure_tiny_snapshot(snap)  # up to date: left alone
    assert (snap / "generation_config.json").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "generation_config.json"]
