"""The tiny random Qwen3-TTS model: what every service serves when no --model is given, and the
tests' model.

`snapshot` writes the folder, `tokenizer` its text tokenizer, `codec` its speech tokenizer. This
module imports no torch (the launcher imports it); building a snapshot does."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from qtts.resources import state_dir

# The model every service serves when no --model is given: built once, git-ignored. Its folder name
# is the served model name.
DEFAULT_TINY_SNAPSHOT = state_dir() / ".tiny" / "qwen3-tts-tiny-base"


# Random weights never say end-of-speech: a request without a length bound ends as "length" after
# about a real speaking rate (1.5 frames of 80 ms per tiny-tokenizer token) instead of failing at
# the text's frame cap. The generation_config.json key is qtts.model.bundle.DEFAULT_LENGTH_KEY
# (spelled out here: importing qtts.model loads torch).
TINY_DEFAULT_LENGTH = {"qtts_default_frames_per_text_token": 1.5}


def build_tiny_snapshot(out_dir, model_type: str = "base", seed: int = 0):
    """See `qtts.tiny_model.snapshot.build_tiny_snapshot`."""
    from qtts.tiny_model.snapshot import build_tiny_snapshot as _build

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
    else:
        _update_generation_config(path)
    return path


def _update_generation_config(path: Path) -> None:
    """Give a snapshot built by an older checkout the tiny default length (its weights stay): one
    without it fails every request that gives no length bound."""
    file = path / "generation_config.json"
    try:
        current = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # not a snapshot this checkout built; loading it reports what is wrong
    if all(current.get(k) == v for k, v in TINY_DEFAULT_LENGTH.items()):
        return
    tmp = file.with_name(file.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**current, **TINY_DEFAULT_LENGTH}, indent=2), encoding="utf-8")
    os.replace(tmp, file)  # atomic: a service starting alongside reads the old file or the new


__all__ = ["DEFAULT_TINY_SNAPSHOT", "TINY_DEFAULT_LENGTH", "build_tiny_snapshot", "ensure_tiny_snapshot"]
