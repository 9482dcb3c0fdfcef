"""Tiny random Qwen3-TTS snapshots for tests and the local default model."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qtts.resources import state_dir

# The model every service serves when no --model is given: built once, git-ignored. Its folder name
# is the served model name.
DEFAULT_TINY_SNAPSHOT = state_dir() / ".tiny" / "qwen3-tts-tiny-base"


def build_tiny_snapshot(out_dir, model_type: str = "base", seed: int = 0):
    """See `qtts.testing.tiny.build_tiny_snapshot`."""
    from qtts.testing.tiny import build_tiny_snapshot as _build

    return _build(out_dir, model_type=model_type, seed=seed)


def ensure_tiny_snapshot(path: Path = DEFAULT_TINY_SNAPSHOT, model_type: str = "base") -> Path:
    """Build the tiny random snapshot at `path` unless one is there already.

    Several services may start at once: each builds into its own temporary folder and the first
    rename wins, so nobody ever loads a half-written snapshot.
    """
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_snapshot(tmp, model_type)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(path)
        except OSError:  # built concurrently by another process: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    return path


__all__ = ["DEFAULT_TINY_SNAPSHOT", "build_tiny_snapshot", "ensure_tiny_snapshot"]
