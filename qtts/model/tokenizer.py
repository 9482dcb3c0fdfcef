"""Text tokenizer of a snapshot, producing the same ids as the official loader.

The official wrapper loads its processor with `AutoProcessor.from_pretrained(folder,
fix_mistral_regex=True)`. In transformers 4.57.3 that flag does something for Qwen3-TTS: for a
local folder whose base vocabulary is larger than 100000 and whose `config.json` says
`transformers_version` > 4.57.2 and < 5.0.0 (or says nothing), the first pre-tokenizer (Qwen2's
split regex) is replaced by the "fixed Mistral" regex. The real checkpoints are saved with 4.57.3,
so the official ids come from the swapped regex. We load the tokenizer without the flag and apply
the same rule ourselves, so the ids do not depend on the installed transformers version (5.x
dropped or changed the flag).

The added-token layout of a Qwen3-TTS `tokenizer_config.json` (Qwen3's special tokens followed by
the TTS ones, at the ids `config.json` names) lives here too: both tokenizers we assemble without
a real snapshot (the tiny test one and Qwen's real BPE for dummy loads) write it.
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

BASE_VOCAB_SIZE = 151643  # Qwen's byte-level BPE entries; the added tokens start here

# id -> content, Qwen3 special tokens followed by the TTS ones.
SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151654: "<|vision_pad|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
    151669: "<|audio_start|>",
    151670: "<|audio_end|>",
    151671: "<tts_pad>",
    151672: "<tts_text_bos>",
    151673: "<tts_text_eod>",
    151674: "<tts_text_bos_single>",
    151675: "<|audio_pad|>",
}
# Tokens the Qwen2 tokenizer treats as special (not split, skipped on decode).
_NOT_SPECIAL = {151657, 151658, 151665, 151666, 151667, 151668}


def qwen2_tokenizer_config(tokens: dict[int, str], **extra: object) -> dict:
    """A Qwen2 `tokenizer_config.json` with `tokens` added at their ids (the ones in `_NOT_SPECIAL`
    split and decoded as text); `extra` entries follow `additional_special_tokens`."""
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": i not in _NOT_SPECIAL,
        }
        for i, s in tokens.items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [s for i, s in tokens.items() if i not in _NOT_SPECIAL and i != 151643],
        **extra,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_config(out_dir: str | Path) -> None:
    """Write a Qwen3-TTS `tokenizer_config.json` (added tokens at the ids above) into `out_dir`."""
    with open(Path(out_dir) / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(qwen2_tokenizer_config(SPECIAL_TOKENS), f, ensure_ascii=False, indent=2)


def config_id_mismatches(tok, cfg) -> list[str]:
    """`config.json`'s text and TTS token ids (a `ModelConfig`) that `tok` does not map to the
    Qwen3-TTS tokens; empty when all five agree. A tokenizer assembled with the layout above is
    only right for configs that use the same ids."""
    expected = {
        "<|im_start|>": cfg.im_start_id,
        "<|im_end|>": cfg.im_end_id,
        "<tts_pad>": cfg.tts_pad_id,
        "<tts_text_bos>": cfg.tts_bos_id,
        "<tts_text_eod>": cfg.tts_eos_id,
    }
    return [
        f"{t} is {tok.convert_tokens_to_ids(t)}, config.json says {i}"
        for t, i in expected.items()
        if tok.convert_tokens_to_ids(t) != i
    ]


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


def load_text_tokenizer(folder: str | Path, config_folder: str | Path | None = None):
    """A `PreTrainedTokenizerFast` for `folder` whose ids equal the official processor's.

    `config_folder` (default `folder`) is the snapshot whose `config.json` decides the regex
    swap: a tokenizer assembled elsewhere for a config-only snapshot tokenises as that snapshot
    would with its own tokenizer files."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), fix_mistral_regex=False)
    except TypeError:  # a transformers version without the flag
        tok = AutoTokenizer.from_pretrained(str(folder))
    if official_swaps_regex(config_folder or folder, tok.vocab_size):
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


def encode_many(tok, texts: list[str]) -> list[list[int]]:
    """`encode` of each text, in one tokenizer call (a fast tokenizer releases the GIL once per
    call, and a thread that releases it waits to take it back)."""
    if not texts:
        return []
    return [list(ids) for ids in tok(texts)["input_ids"]]
