"""Session-scoped tiny snapshots (shared with the codec-side tests) and official-package models."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_snapshot_factory(tmp_path_factory):
    """`tiny_snapshot_factory(model_type) -> Path`: a tiny random snapshot, built once per type."""
    from qtts.tiny_model import build_tiny_snapshot

    built: dict[str, Path] = {}

    def make(model_type: str = "base") -> Path:
        if model_type not in built:
            root = tmp_path_factory.mktemp(f"tiny-{model_type}")
            built[model_type] = build_tiny_snapshot(root / f"qwen3-tts-tiny-{model_type}", model_type, seed=0)
        return built[model_type]

    return make


@pytest.fixture(scope="session")
def official_factory(tiny_snapshot_factory):
    """`official_factory(model_type)`: the official `Qwen3TTSModel` on the tiny snapshot (cached)."""
    from tests.qtts.model.reference import load_official

    loaded = {}

    def make(model_type: str):
        if model_type not in loaded:
            loaded[model_type] = load_official(tiny_snapshot_factory(model_type))
        return loaded[model_type]

    return make


@pytest.fixture(scope="session")
def bundle_factory(tiny_snapshot_factory):
    """`bundle_factory(model_type)`: our `TalkerBundle` on the tiny snapshot (cached)."""
    from qtts.model import load_talker_bundle

    loaded = {}

    def make(model_type: str):
        if model_type not in loaded:
            loaded[model_type] = load_talker_bundle(tiny_snapshot_factory(model_type))
        return loaded[model_type]

    return make
