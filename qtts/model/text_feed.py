"""Text that arrives while a request runs: word-safe tokenisation and the feed of trailing text.

The streaming-text prompt feeds one text token per generated frame (DESIGN.md section 3), so a
running generation can take text appended after it started:

- `TextPieces` tokenises text as it arrives, holding back the last pre-token (a word may still
  grow: "is" -> "island"), so the ids handed out are always a prefix of the ids of the whole text
  and BPE merges come out as if the text had been sent whole;
- `TextFeed` carries the embeddings of those ids from the talker's prompt thread to the engine
  thread. While the feed is open and its queue has no token for the next frame, the stream is not
  stepped (`ready` is False): it waits in the batch instead of being fed `tts_pad`, which would
  let the model end its speech. Once closed (`tts_eos` appended), it runs as a whole-text
  request does: `tts_pad` after the text, and the model may end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# Earlier cut points tried when the ids of the text up to the latest one are not a prefix of the
# ids of all the text received (a merge across the cut): each try costs one tokenisation.
MAX_CUT_TRIES = 4


def pre_token_starts(tokenizer: Any) -> Callable[[str], list[int]]:
    """`starts(text)`: the character offsets where the tokenizer's pre-tokens begin.

    BPE merges never cross a pre-token boundary, so these are the only places a text can be cut
    without changing its ids. A tokenizer without a pre-tokenizer we can ask falls back to the
    starts of whitespace-led words (the verification in `TextPieces` still guards every cut)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = getattr(backend, "pre_tokenizer", None)
    if pre is not None and hasattr(pre, "pre_tokenize_str"):
        return lambda text: [start for _, (start, _) in pre.pre_tokenize_str(text)]

    def whitespace_starts(text: str) -> list[int]:
        return [0] + [i for i in range(1, len(text)) if text[i].isspace() and not text[i - 1].isspace()]

    return whitespace_starts


class TextPieces:
    """Ids of a text received in pieces, handed out as soon as they can no longer change.

    `encode(text)` must give the ids of `text` in its prompt context as a whole-text request
    tokenises it (role ids included, so a merge into the role shows up too); `encode_more(text)`
    the ids of text that follows a cut, on its own. After the first cut only
    the text since the last one is tokenised: a cut is a pre-token boundary, where the
    pre-tokenizer starts afresh, so the ids of the pieces between cuts add up to the whole text's
    (and a long utterance costs the prompt thread linear, not quadratic, time). `push` returns the
    new ids of the text that is safe so far, `finish` the rest once the text is complete."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        starts: Callable[[str], list[int]],
        encode_more: Callable[[str], list[int]],
    ):
        self._encode = encode
        self._encode_more = encode_more
        self._starts = starts
        self.text = ""
        self.committed_chars = 0  # text[:committed_chars] has its ids out
        self.ids: list[int] = []  # encode(text[:committed_chars])

    @property
    def committed_text(self) -> str:
        return self.text[: self.committed_chars]

    def push(self, piece: str) -> list[int]:
        """Append `piece`; the ids that became safe (maybe none)."""
        self.text += piece
        base = self.committed_chars
        # Cut at a pre-token start: the last pre-token (from the last start on) may still grow.
        cuts = [base + c for c in self._starts(self.text[base:]) if c > 0]
        if not cuts:
            return []
        whole = self._ids_since_cut(len(self.text))
        for cut in reversed(cuts[-MAX_CUT_TRIES:]):
            ids = self._ids_since_cut(cut)
            if whole[: len(ids)] == ids:
                return self._commit(cut, ids)
        return []

    def _ids_since_cut(self, end: int) -> list[int]:
        """The ids of text[committed_chars:end] (with the role, before the first cut)."""
        if self.committed_chars == 0:
            return self._encode(self.text[:end])
        return self._encode_more(self.text[self.committed_chars : end])

    def finish(self, piece: str = "") -> list[int]:
        """Append the last `piece`; all the ids not handed out yet. Trailing whitespace not handed
        out goes, as the gateway strips a whole text."""
        text = self.text + piece
        self.text = text[: max(self.committed_chars, len(text.rstrip()))]
        if len(self.text) == self.committed_chars:
            return []
        return self._commit(len(self.text), self._ids_since_cut(len(self.text)))

    def _commit(self, cut: int, new: list[int]) -> list[int]:
        self.committed_chars = cut
        self.ids = self.ids + new
        return new


class TextFeed:
    """Trailing text embeddings of a running request whose text is still open.

    The prompt thread appends (`append`, then `close` with `tts_eos`); the engine thread reads
    the chunks it has not taken (`chunks_from`) before each step and asks `ready(frames)`: the
    step that makes frame `frames` feeds trailing position `frames` into the next input, so it
    may run only once that position exists or the text is closed (then `tts_pad` follows)."""

    def __init__(self, num_positions: int):
        self._lock = threading.Lock()
        self._chunks: list[Any] = []
        # Trailing positions known: the prompt's own trailing text plus every appended chunk.
        self.num_positions = num_positions
        self.closed = False
        # Set on close, from the whole text: its frame cap, default length and token count.
        self.max_frames: int | None = None
        self.default_max_frames: int | None = None
        self.num_text_tokens = 0

    def append(self, embeds: Any) -> None:
        """Embeddings [k, H] of text that arrived; k may be 0."""
        if embeds.shape[0] == 0:
            return
        with self._lock:
            if self.closed:
                raise ValueError("text appended after the text was closed")
            self._chunks.append(embeds)
            self.num_positions += int(embeds.shape[0])

    def close(
        self, embeds: Any, *, max_frames: int, default_max_frames: int | None, num_text_tokens: int
    ) -> None:
        """The last embeddings (ending with `tts_eos`) and the bounds of the whole text."""
        with self._lock:
            self._chunks.append(embeds)
            self.num_positions += int(embeds.shape[0])
            self.max_frames = max_frames
            self.default_max_frames = default_max_frames
            self.num_text_tokens = num_text_tokens
            self.closed = True

    def ready(self, frames: int) -> bool:
        """Whether the step that makes frame `frames` (0-based) has its text."""
        return self.closed or self.num_positions > frames

    def chunks_from(self, index: int) -> tuple[list[Any], bool]:
        """Chunks `index`.. and whether the feed is closed (every chunk is then among them)."""
        with self._lock:
            return self._chunks[index:], self.closed
