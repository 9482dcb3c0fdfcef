"""One request whose text arrives while it runs: pieces -> its prompt, then appended trailing text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from qtts.model.prompt import NeedMoreText, PromptBuilder, SynthesisSpec, TalkerPrompt
from qtts.model.text_feed import TextPieces, pre_token_starts
from qtts.request.errors import InvalidArgument

ROLE_IDS = 3  # `<|im_start|>assistant\n`: the target's ids follow them


class OpenText:
    """The text of one text-open request, piece by piece (one thread calls it, in order).

    Until the prompt exists, pieces accumulate; `push` returns the prompt once its safe text is
    enough to build it (an ICL prompt also needs its text to reach past the reference frames, as
    a whole text would). A text that ends before that is built as a whole-text prompt. After the
    prompt, each piece's new ids are embedded and appended to the prompt's `TextFeed`; the last
    one closes it with `tts_eos` and the bounds of the whole text.

    `sync` runs before embeddings are handed to the feed (on a GPU: wait for the stream that
    computed them, since the engine reads them from its own); `max_positions` bounds the trailing
    positions the engine can hold per stream (None: no bound)."""

    def __init__(
        self,
        builder: PromptBuilder,
        spec: SynthesisSpec,
        max_positions: int | None = None,
        sync: Callable[[], None] = lambda: None,
    ):
        self._builder = builder
        self._spec = spec
        self._max_positions = max_positions
        self._sync = sync
        self._pieces = TextPieces(
            builder.role_and_target_ids, pre_token_starts(builder.tokenizer), builder.text_ids
        )
        self.prompt: TalkerPrompt | None = None
        self.closed = False

    @property
    def text(self) -> str:
        return self._pieces.text

    @torch.no_grad()
    def push(self, piece: str, final: bool = False) -> TalkerPrompt | None:
        """Take the next piece (`final`: the text ends with it). Returns the prompt the first
        time it can be built, else None."""
        if self.closed:
            raise InvalidArgument("text appended after the end of the text")
        self.closed = final
        if self.prompt is None:
            return self._try_prompt(piece, final)
        new = self._pieces.finish(piece) if final else self._pieces.push(piece)
        self._append(new, final)
        return None

    def _try_prompt(self, piece: str, final: bool) -> TalkerPrompt | None:
        if final:
            self._pieces.finish(piece)
            # Complete before the prompt could start: a whole-text request, exactly.
            self.prompt = self._builder.build(replace(self._spec, text=self._pieces.text, text_open=False))
            return self.prompt
        self._pieces.push(piece)
        text = self._pieces.committed_text
        if not text.strip():
            return None
        try:
            prompt = self._builder.build(replace(self._spec, text=text, text_open=True))
        except NeedMoreText:
            return None
        self._check_room(prompt.text_feed.num_positions)
        self.prompt = prompt
        return prompt

    def _check_room(self, positions: int) -> None:
        # One position stays free for tts_eos.
        if self._max_positions is not None and positions + 1 > self._max_positions:
            raise InvalidArgument(
                f"the text is too long for this talker: {positions + 1} text positions after the prompt, "
                f"at most {self._max_positions}; end the utterance sooner"
            )

    def _append(self, ids: list[int], final: bool) -> None:
        feed = self.prompt.text_feed
        b = self._builder
        embeds = b.text_embeds(ids)
        if not final:
            if not ids:
                return
            self._check_room(feed.num_positions + len(ids))
            self._sync()
            feed.append(embeds)
            return
        self._check_room(feed.num_positions + len(ids))
        num_tokens = len(self._pieces.ids) - ROLE_IDS
        if num_tokens < 1:
            raise InvalidArgument("text has no tokens")
        cap, default = b.text_bounds(num_tokens)
        last = torch.cat([embeds, b.eos_embed()])
        self._sync()
        feed.close(last, max_frames=cap, default_max_frames=default, num_text_tokens=num_tokens)
