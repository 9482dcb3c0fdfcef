"""Text tokenizer of a snapshot, producing the same ids as the official loader.

The official wrapper loads its processor with `AutoProcessor.from_pretrained(folder,
fix_mistral_regex=True)`. In transformers 4.57.3 that flag does something for Qwen3-TTS: for a
local folder whose base vocabulary is larger than 100000 and whose `config.json` says
`transformers_version` > 4.57.2 and < 5.0.0 (or says nothing), the first pre-tokenizer (Qwen2's
split regex) is replaced by the "fixed Mistral" regex. The real checkpoints are saved with 4.57.3,
so the official ids come from the swapped regex. We load the tokenizer without the flag and apply
the same rule ourselves, so the ids do not depend on the installed transformers version (5.x
dropped or changed the flag).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

MISTRAL_FIXED_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_MISTRAL_TYPES = {"mistral", "mistral3", "voxtral", "ministral", "pixtral"}


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def official_swaps_regex(folder: str | Path, base_vocab_size: int) -> bool:
    """Whether `fix_mistral_regex=True` in transformers 4.57.3 swaps the regex for this folder."""
    if base_vocab_size <= 100000:
        return False
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        return False
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    version = cfg.get("transformers_version")
    model_type = cfg.get("model_type")
    if version:
        v = _version_tuple(str(version))
        if v <= (4, 57, 2) and model_type is not None and model_type not in _MISTRAL_TYPES:
            return False
        if v >= (5, 0, 0):
            return False
    return True


def load_text_tokenizer(folder: str | Path):
    """A `PreTrainedTokenizerFast` for `folder` whose ids equal the official processor's."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), fix_mistral_regex=False)
    except TypeError:  # a transformers version without the flag
        tok = AutoTokenizer.from_pretrained(str(folder))
    if official_swaps_regex(folder, tok.vocab_size):
        import tokenizers

        split = tokenizers.pre_tokenizers.Split(
            pattern=tokenizers.Regex(MISTRAL_FIXED_REGEX), behavior="isolated"
        )
        backend = tok.backend_tokenizer
        pre = backend.pre_tokenizer
        if isinstance(pre, tokenizers.pre_tokenizers.Sequence):
            pre[0] = split
        else:
            backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
                [split, tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        log.debug("applied the official fix_mistral_regex pre-tokenizer swap for %s", folder)
    return tok


def encode(tok, text: str) -> list[int]:
    """Token ids of `text` as the official processor computes them (no padding, no BOS)."""
    return list(tok(text)["input_ids"])
