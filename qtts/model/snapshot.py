"""Locating and validating a Qwen3-TTS-12Hz snapshot folder.

`path_or_id` is a local folder, a hub id (downloaded with `huggingface_hub.snapshot_download`
only when no such local path exists), or for `load_format="dummy"` the name of a shipped
full-size config under `configs/`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from qtts import resources
from qtts.model.config import MODEL_TYPES, ModelConfig

log = logging.getLogger(__name__)

CONFIGS_DIR = resources.CONFIGS_DIR
LOAD_FORMATS = ("auto", "safetensors", "dummy")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


class SnapshotError(ValueError):
    """The path is not a usable Qwen3-TTS snapshot (or not the expected variant)."""


@dataclass(frozen=True)
class Snapshot:
    folder: Path
    name: str
    config: ModelConfig
    load_format: str  # "safetensors" | "dummy"

    @property
    def has_tokenizer(self) -> bool:
        return all((self.folder / f).is_file() for f in TOKENIZER_FILES)

    @property
    def weight_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            return [self.folder / n for n in names]
        return [self.folder / "model.safetensors"]

    @property
    def speech_tokenizer_dir(self) -> Path:
        own = self.folder / "speech_tokenizer"
        # The shipped full-size configs share one codec config: configs/speech_tokenizer/.
        if not own.is_dir() and self.folder.parent == CONFIGS_DIR:
            return CONFIGS_DIR / "speech_tokenizer"
        return own


def shipped_configs() -> list[str]:
    if not CONFIGS_DIR.is_dir():
        return []
    return sorted(
        p.name
        for p in CONFIGS_DIR.iterdir()
        if (p / "config.json").is_file() and p.name.startswith("qwen3-tts")
    )


def _served_name(path_or_id: str, folder: Path) -> str:
    p = Path(path_or_id)
    name = p.name if p.exists() else path_or_id.rstrip("/").split("/")[-1]
    return (name or folder.name).lower()


def _resolve_folder(path_or_id: str, load_format: str) -> Path:
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise SnapshotError(f"{path_or_id}: not a folder (expected a Qwen3-TTS snapshot folder)")
        return p
    if load_format == "dummy" and (CONFIGS_DIR / path_or_id / "config.json").is_file():
        return CONFIGS_DIR / path_or_id
    if path_or_id.count("/") != 1 or path_or_id.startswith((".", "/")):
        hint = (
            f"; shipped configs for --load-format dummy: {', '.join(shipped_configs())}"
            if load_format == "dummy"
            else ""
        )
        raise SnapshotError(f"{path_or_id}: no such folder, and not a hub id (owner/name){hint}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=path_or_id))
    except Exception as e:  # offline, unknown repo, auth
        raise SnapshotError(
            f"{path_or_id}: no such local folder and the hub download failed ({type(e).__name__}: {e})"
        ) from e


def open_snapshot(
    path_or_id: str | Path, load_format: str = "auto", expect_model_type: str | None = None
) -> Snapshot:
    """Find and validate a snapshot; raises `SnapshotError` with a message naming what is wrong."""
    if load_format not in LOAD_FORMATS:
        raise SnapshotError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if expect_model_type is not None and expect_model_type not in MODEL_TYPES:
        raise SnapshotError(f"expect_model_type must be one of {MODEL_TYPES}, got {expect_model_type!r}")
    path_or_id = str(path_or_id)
    folder = _resolve_folder(path_or_id, load_format)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SnapshotError(f"{folder}: not a Qwen3-TTS snapshot (no config.json)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SnapshotError(f"{cfg_path}: unreadable config.json ({e})") from e
    if raw.get("model_type") != "qwen3_tts":
        raise SnapshotError(
            f"{folder}: not a Qwen3-TTS snapshot (config.json model_type is {raw.get('model_type')!r}, "
            "expected 'qwen3_tts')"
        )
    mtype = raw.get("tts_model_type")
    if mtype not in MODEL_TYPES:
        raise SnapshotError(f"{folder}: config.json tts_model_type {mtype!r} is not one of {MODEL_TYPES}")
    if expect_model_type is not None and mtype != expect_model_type:
        raise SnapshotError(
            f"{folder}: the snapshot is a {mtype!r} model but {expect_model_type!r} was expected"
        )
    tok_type = raw.get("tokenizer_type")
    if tok_type is not None and "12hz" not in str(tok_type).lower():
        raise SnapshotError(f"{folder}: tokenizer_type {tok_type!r} is not supported (only the 12 Hz codec)")
    try:
        config = ModelConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"{cfg_path}: malformed Qwen3-TTS config ({type(e).__name__}: {e})") from e
    fmt = "dummy" if load_format == "dummy" else "safetensors"
    snap = Snapshot(folder=folder, name=_served_name(path_or_id, folder), config=config, load_format=fmt)
    if fmt == "safetensors":
        missing = [f.name for f in snap.weight_files if not f.is_file()]
        missing += [f for f in TOKENIZER_FILES if not (folder / f).is_file()]
        if not (folder / "speech_tokenizer" / "config.json").is_file():
            missing.append("speech_tokenizer/config.json")
        if missing:
            raise SnapshotError(f"{folder}: incomplete Qwen3-TTS snapshot, missing {', '.join(missing)}")
    return snap
