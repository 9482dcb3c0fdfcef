"""Talker prompts as ids and rows laid out on the host, then summed a batch at a time.

Every prompt position is T(text id) plus one codec-track row (DESIGN.md section 3): the zero row
(instruct and role positions), C(a control, language or speaker id), a voice's speaker embedding,
or C(codec_bos) and the reference frames of a voice. `PromptLayout` is one prompt in those terms,
laid out in plain Python; `materialise` sums a batch of them with two gathers (T(.) rows are kept
per token, `PromptEmbeddings.text_rows`) and one add, and splits the sums into the prompts' embeddings and trailing text.

Why: each device call releases the GIL, and the prompt thread takes it back only when the engine
thread or the command reader yields it, after up to a switch interval. A prompt built piece by
piece made ~30 such calls (1.5 ms alone on the CPU, 10 ms beside one busy Python thread); a batch
laid out here makes about fifteen, whatever its size.

Codec rows are numbered per prompt: 0 is the zero row, 1..K the model's control / language /
speaker ids (`CodecTable`), and K+1.. the prompt's voice rows (its speaker embedding, then
C(codec_bos) and its reference frames); `materialise` moves the voice rows to where the batch's
table holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qtts.request.errors import InvalidArgument

if TYPE_CHECKING:
    from qtts.model.prompt import VoicePrompt
    from qtts.model.prompt_key import PrefixHasher


class NeedMoreText(InvalidArgument):
    """A text-open ICL prompt whose text does not yet fill the reference frames: a whole-text
    prompt would pad it with tts_pad, so the prompt waits for more text (or the end of it)."""


@dataclass
class PromptLayout:
    """One prompt as ids and codec rows, and what the `TalkerPrompt` carries besides embeddings."""

    text_ids: list[int]  # the text track of each prefill position
    codec_rows: list[int]  # the codec track of each prefill position (numbered as above)
    trailing_ids: list[int]  # text fed one per generated frame
    voice_key: bytes | None  # the voice whose rows the prompt uses (None: none)
    voice_rows: torch.Tensor | None  # [1 + frames, H] on the device: speaker, C(bos), frames
    meta: dict[str, Any] = field(default_factory=dict)  # the rest of the TalkerPrompt's fields


class CodecTable:
    """C(.) of every control, language and speaker id of a model, computed once, and the zero row:
    the first 1 + K rows of every batch's codec table."""

    def __init__(self, config: Any, embed: Any):
        tcfg = config.talker
        ids = {
            tcfg.codec_pad_id,
            tcfg.codec_bos_id,
            tcfg.codec_think_id,
            tcfg.codec_nothink_id,
            tcfg.codec_think_bos_id,
            tcfg.codec_think_eos_id,
            *tcfg.language_ids.values(),
            *tcfg.speaker_ids.values(),
        }
        self.ids = sorted(ids)
        self._row = {cid: 1 + i for i, cid in enumerate(self.ids)}
        self.voice_base = 1 + len(self.ids)  # the first voice row of a prompt
        self._embed = embed
        self._table: torch.Tensor | None = None

    def row(self, codec_id: int) -> int:
        return self._row[codec_id]

    def rows(self, codec_ids: list[int]) -> list[int]:
        return [self._row[c] for c in codec_ids]

    def table(self) -> torch.Tensor:
        """[1 + K, H]: the zero row, then C(id) of each id (made on first use)."""
        if self._table is None:
            codec = self._embed.codec_many(self.ids)
            self._table = torch.cat([torch.zeros_like(codec[:1]), codec])
        return self._table


def materialise(
    layouts: list[PromptLayout], codecs: CodecTable, embed: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(embeddings [L, H], trailing text [N, H]) of each layout, in a fixed number of device calls.

    The trailing rows are a tensor of their own: a request keeps its trailing text while it runs,
    and a view would keep the whole batch's embeddings alive with it."""
    voice_at: dict[bytes, int] = {}
    voice_tables = []
    at = codecs.voice_base
    ids: list[int] = []
    rows = []
    for lay in layouts:
        ids.extend(lay.text_ids)
        local = np.asarray(lay.codec_rows, dtype=np.int64)
        if lay.voice_key is not None:
            base = voice_at.get(lay.voice_key)
            if base is None:
                base = voice_at[lay.voice_key] = at
                voice_tables.append(lay.voice_rows)
                at += int(lay.voice_rows.shape[0])
            local[local >= codecs.voice_base] += base - codecs.voice_base
        rows.append(local)
    positions = len(ids)
    for lay in layouts:
        ids.extend(lay.trailing_ids)
    text_host = np.asarray(ids, dtype=np.int64)
    dev = embed.host_ids(np.concatenate([text_host, *rows]))
    table = torch.cat([codecs.table(), *voice_tables]) if voice_tables else codecs.table()
    summed = torch.index_select(table, 0, dev[len(ids) :])
    summed.add_(embed.text_rows(text_host[:positions], dev[:positions]))
    trailing = embed.text_rows(text_host[positions:], dev[positions : len(ids)])
    embeds = summed.split([len(lay.text_ids) for lay in layouts])
    trails = trailing.split([len(lay.trailing_ids) for lay in layouts])
    return list(zip(embeds, trails, strict=True))


def icl_layout(
    config: Any,
    codecs: CodecTable,
    voice: VoicePrompt,
    parts: tuple,
    target: list[int],
    streaming: bool,
    open_: bool,
    key: PrefixHasher,
    text_ids: list[int],
    codec_rows: list[int],
) -> tuple[list[int], int]:
    """Lay out the body of an ICL prompt (appended to `text_ids` / `codec_rows`); (trailing
    text ids, leading body positions that depend on the voice only). The reference side goes
    into `key`."""
    _, ref_ids, _, codes_key = parts
    # Body position i is T(x_i) + Y_i (streaming) or T(x_i) + C(pad) (non-streaming) with
    # x = ref tokens + target tokens + tts_eos and Y = C(codec_bos), reference frames: the
    # first target token enters at body position len(ref_ids).
    key.add("icl_streaming", bool(streaming))
    key.add("ref_text", ref_ids)
    key.add_raw("ref_codes", codes_key)
    cfg = config
    x = ref_ids + target if open_ else ref_ids + target + [cfg.tts_eos_id]
    cl = int(voice.ref_codes.shape[0]) + 1  # C(codec_bos) and the reference frames
    if open_ and len(x) < cl:
        # The whole text might still end inside the reference frames (padded there).
        raise NeedMoreText("the text so far does not reach past the reference frames")
    frames = list(range(codecs.voice_base + 1, codecs.voice_base + 1 + cl))
    tl = len(x)
    if not streaming:
        text_ids += x + [cfg.tts_pad_id] * cl
        codec_rows += [codecs.row(cfg.talker.codec_pad_id)] * tl + frames
        return [], len(ref_ids)
    codec_rows += frames
    if tl > cl:
        text_ids += x[:cl]
        return x[cl:], len(ref_ids)
    text_ids += x + [cfg.tts_pad_id] * (cl - tl)
    return [], len(ref_ids)


def text_layout(
    config: Any,
    codecs: CodecTable,
    ids: list[int],
    target: list[int],
    codec: list[int],
    streaming: bool,
    open_: bool,
    text_ids: list[int],
    codec_rows: list[int],
) -> list[int]:
    """Lay out the body of a prompt without reference frames; its trailing text ids: streaming,
    the first target token on the last codec position and the rest trailing; else the whole
    text."""
    cfg = config
    if streaming:
        text_ids.append(ids[3])
        codec_rows.append(codec[-1])
        rest = ids[4:-5] if len(target) > 1 else []
        return rest if open_ else rest + [cfg.tts_eos_id]
    body = target + [cfg.tts_eos_id]
    text_ids += body + [cfg.tts_pad_id]
    pad_row, bos_row = codecs.rows([cfg.talker.codec_pad_id, cfg.talker.codec_bos_id])
    codec_rows += [pad_row] * len(body) + [bos_row]
    return []


__all__ = ["CodecTable", "NeedMoreText", "PromptLayout", "icl_layout", "materialise", "text_layout"]
