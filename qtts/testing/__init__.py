"""Tiny random Qwen3-TTS snapshots for tests and the local default model."""

from __future__ import annotations


def build_tiny_snapshot(out_dir, model_type: str = "base", seed: int = 0):
    """See `qtts.testing.tiny.build_tiny_snapshot`."""
    from qtts.testing.tiny import build_tiny_snapshot as _build

    return _build(out_dir, model_type=model_type, seed=seed)


__all__ = ["build_tiny_snapshot"]
