"""A small, deterministic byte-level BPE tokenizer laid out like Qwen's.

No real Qwen vocabulary can be downloaded here, so this trains a tiny BPE on a few built-in
sentences, pads the base vocabulary to Qwen's 151643 entries with unreachable filler tokens and
puts the special tokens at Qwen's real ids (151643 `<|endoftext|>`, 151644 `<|im_start|>`, ...,
151671 tts_pad, 151672 tts_bos, 151673 tts_eos). The files are the ones a real snapshot ships
(`vocab.json`, `merges.txt`, `tokenizer_config.json`), so `transformers` builds the fast tokenizer
with the Qwen2 converter exactly as it does for a real checkpoint, and the base vocabulary is larger
than 100000, so the `fix_mistral_regex` path of transformers 4.57.3 is exercised too.
"""

from __future__ import annotations

import json
from pathlib import Path

BASE_VOCAB_SIZE = 151643

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

TRAINING_TEXT = [
    "Hello world, this is a tiny tokenizer for tests.",
    "The quick brown fox jumps over the lazy dog. It's 12:30 and we're 100% sure!",
    "Speak slowly and clearly, with a warm and friendly voice.",
    "A calm female voice, low pitch; happy tone? Yes. I'll say it again: don't worry.",
    "你好，世界。今天天气很好，我们去公园散步吧！",
    "こんにちは、世界。Bonjour le monde. Hallo Welt! ¿Qué tal? Привет, мир.",
    "assistant user system\n\n  tabs\tand   spaces 1234567890",
]


def _train(vocab_size: int = 600) -> tuple[dict[str, int], list[str]]:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(TRAINING_TEXT * 4, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    data = json.loads(tok._tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges = data["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return vocab, merges


def write_tiny_tokenizer(out_dir: str | Path) -> None:
    """Write `vocab.json`, `merges.txt` and `tokenizer_config.json` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = _train()
    full = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    next_id = len(full)
    # Filler entries: valid byte-level strings that no merge can ever produce.
    while next_id < BASE_VOCAB_SIZE:
        full[f"<|filler_{next_id}|>"] = next_id
        next_id += 1
    with open(out / "vocab.json", "w", encoding="utf-8") as f:
        json.dump(full, f, ensure_ascii=False)
    with open(out / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(m + "\n")
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": i not in _NOT_SPECIAL,
        }
        for i, s in SPECIAL_TOKENS.items()
    }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            s for i, s in SPECIAL_TOKENS.items() if i not in _NOT_SPECIAL and i != 151643
        ],
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
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=2)
