"""Word splitting and timestamp repair of Qwen3-ForcedAligner, as the official `qwen-asr` does them.

The aligner gives every word two slots (start, end). What a "word" is depends on the language:
Japanese is segmented by `nagisa` (imported on first use), every other supported language splits
on whitespace and then cuts CJK ideographs out one per word. Only letters, digits and the
apostrophe survive. Korean is refused rather than split differently from the official code: there
`soynlp`'s `LTokenizer` cuts each space-separated word into a known left part and the rest, the
left parts scored from `korean_dict_jieba.dict` (21,009 words), which only the `qwen-asr` package
ships (`qwen_asr/inference/assets`); neither is a dependency here.

The predicted slots are not guaranteed to rise; `repair_timestamps` keeps the longest
non-decreasing run and fills the rest from its neighbours (nearest for runs of at most two,
linear interpolation for longer ones), as `Qwen3ForceAlignProcessor.fix_timestamp` does.
"""

from __future__ import annotations

import functools
import importlib
import threading
import unicodedata
from collections.abc import Sequence
from types import ModuleType

# Languages the official code splits with a tool of their own.
JAPANESE = "japanese"
KOREAN = "korean"


class UnsupportedLanguage(ValueError):
    """A language whose word splitting is not available here."""


def is_kept_char(ch: str) -> bool:
    if ch == "'":
        return True
    cat = unicodedata.category(ch)
    return cat.startswith("L") or cat.startswith("N")


def clean_token(token: str) -> str:
    return "".join(ch for ch in token if is_kept_char(ch))


_CJK_RANGES = (
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0x3400, 0x4DBF),  # Extension A
    (0x20000, 0x2A6DF),  # Extension B
    (0x2A700, 0x2B73F),  # Extension C
    (0x2B740, 0x2B81F),  # Extension D
    (0x2B820, 0x2CEAF),  # Extension E
    (0xF900, 0xFAFF),  # Compatibility Ideographs
)


def is_cjk_char(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def _split_cjk(segment: str) -> list[str]:
    out: list[str] = []
    buf: list[str] = []
    for ch in segment:
        if is_cjk_char(ch):
            if buf:
                out.append("".join(buf))
                buf = []
            out.append(ch)
        else:
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out


def split_space_language(text: str) -> list[str]:
    words: list[str] = []
    for seg in text.split():
        cleaned = clean_token(seg)
        if cleaned:
            words.extend(_split_cjk(cleaned))
    return words


@functools.cache
def nagisa_module() -> ModuleType:
    """`nagisa`, imported on first use (heavy: DyNet; only Japanese needs it) on a thread of its
    own. Its DyNet library is built with -ffast-math, whose start-up code turns on flush-to-zero
    and denormals-are-zero in the thread that loads it: loaded on a caller's thread, every later
    float operation there read subnormal numbers as 0 (in the test suite, a gateway sharing the
    process took a gRPC temperature of 1e-45 for 0, and hypothesis refused to run). The mode is
    per thread, so the loading thread takes it away with it."""
    got: dict[str, object] = {}

    def load() -> None:
        try:
            got["module"] = importlib.import_module("nagisa")
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            got["error"] = exc

    thread = threading.Thread(target=load, name="nagisa-import", daemon=True)
    thread.start()
    thread.join()
    if "error" in got:
        raise got["error"]  # type: ignore[misc]
    return got["module"]  # type: ignore[return-value]


def split_japanese(text: str) -> list[str]:
    nagisa = nagisa_module()
    return [w for w in (clean_token(t) for t in nagisa.tagging(text).words) if w]


def split_words(text: str, language: str) -> list[str]:
    """The aligner's words of `text` in `language` (a name such as "English"; case is ignored)."""
    lang = language.lower()
    if lang == JAPANESE:
        return split_japanese(text)
    if lang == KOREAN:
        raise UnsupportedLanguage(
            "word timestamps are not available for Korean: the official word splitting (soynlp's "
            "LTokenizer) scores words from a dictionary that only the qwen-asr package ships"
        )
    return split_space_language(text)


def aligner_text(words: Sequence[str]) -> str:
    """The text part of the aligner prompt: each word followed by its two timestamp slots."""
    from qtts.model.aligner.config import AUDIO_END_TOKEN, AUDIO_PAD_TOKEN, AUDIO_START_TOKEN, TIMESTAMP_TOKEN

    slots = TIMESTAMP_TOKEN * 2
    return AUDIO_START_TOKEN + AUDIO_PAD_TOKEN + AUDIO_END_TOKEN + slots.join(words) + slots


def _longest_rising(data: Sequence[float]) -> list[bool]:
    n = len(data)
    length = [1] * n
    parent = [-1] * n
    for i in range(1, n):
        for j in range(i):
            if data[j] <= data[i] and length[j] + 1 > length[i]:
                length[i] = length[j] + 1
                parent[i] = j
    keep = [False] * n
    idx = length.index(max(length))
    while idx != -1:
        keep[idx] = True
        idx = parent[idx]
    return keep


def repair_timestamps(data: Sequence[float]) -> list[int]:
    """Non-decreasing timestamps (ms) from the raw slot predictions; see the module docstring."""
    n = len(data)
    if n == 0:
        return []
    normal = _longest_rising(data)
    result = list(data)
    i = 0
    while i < n:
        if normal[i]:
            i += 1
            continue
        j = i
        while j < n and not normal[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if normal[k]), None)
        right = next((result[k] for k in range(j, n) if normal[k]), None)
        if j - i <= 2:
            for k in range(i, j):
                if left is None:
                    result[k] = right
                elif right is None:
                    result[k] = left
                else:
                    result[k] = left if (k - (i - 1)) <= (j - k) else right
        elif left is not None and right is not None:
            step = (right - left) / (j - i + 1)
            for k in range(i, j):
                result[k] = left + step * (k - i + 1)
        elif left is not None or right is not None:
            fill = left if left is not None else right
            for k in range(i, j):
                result[k] = fill
        i = j
    return [int(r) for r in result]
