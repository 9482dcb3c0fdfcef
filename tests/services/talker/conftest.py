"""Fixtures of the talker tests: tiny real snapshots (built once per session) and their bundles."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory):
    """`make(model_type)` -> the folder of a tiny random snapshot, built once per model type."""
    from qtts.tiny_model import build_tiny_snapshot

    root = Path(tmp_path_factory.mktemp("talker-tiny"))
    paths: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in paths:
            paths[model_type] = Path(build_tiny_snapshot(root / model_type, model_type))
        return paths[model_type]

    return make


@pytest.fixture(scope="session")
def tiny_talker_bundle(tiny_snapshot):
    """`make(model_type)` -> a TalkerBundle of the tiny snapshot, loaded once per model type."""
    from qtts.model import load_talker_bundle

    bundles: dict[str, object] = {}

    def make(model_type: str):
        if model_type not in bundles:
            bundles[model_type] = load_talker_bundle(tiny_snapshot(model_type))
        return bundles[model_type]

    return make
