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

# The added-token layout (`qtts.model.tokenizer.SPECIAL_TOKENS`) is shared with the real-BPE
# tokenizer of dummy loads (`qtts.model.bpe_vocab`).
from qtts.model.tokenizer import BASE_VOCAB_SIZE, write_tokenizer_config

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
    write_tokenizer_config(out)
