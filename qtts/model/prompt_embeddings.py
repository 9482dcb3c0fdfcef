"""The embeddings a talker prompt is summed from, on the talker's device: text-track T(ids),
codec-track C(ids) and whole frames, with those that do not depend on the target text kept.

Special tokens, roles, codec ids and each voice's speaker embedding and reference frames are kept
(LRU), so a request's prompt costs a few device calls, not dozens: one prompt thread builds every
prompt in the talker. Host ids and voice tensors reach a CUDA device pinned and non-blocking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qtts.lru import BoundedLru

_MEMO_IDS = 8  # codec id lists up to this long have their embeddings kept (control ids)
TEXT_GROUP = 64  # new text tokens are projected this many rows at a time (see `text_rows`)


class PromptEmbeddings:
    """T(.), C(.) and frame embeddings of a loaded talker and code predictor, kept where reusable."""

    def __init__(self, talker, code_predictor):
        self.talker = talker
        self.code_predictor = code_predictor
        self._memo: BoundedLru[tuple, object] = BoundedLru(512)
        self._memo_lock = threading.Lock()
        self._text_table: torch.Tensor | None = None  # T(id) of every token met so far, by id
        self._text_known: np.ndarray | None = None

    def device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    def ids(self, ids: list[int]) -> torch.Tensor:
        """`ids` as a [1, n] long tensor on the model's device."""
        device = self.device()
        host = torch.tensor([ids], dtype=torch.long)
        if device.type != "cuda":
            return host.to(device)
        # Pinned and non-blocking: a plain copy from pageable memory waits until the GPU has run
        # everything queued before it, i.e. the engine's frame step, on every prompt built.
        return host.pin_memory().to(device, non_blocking=True)

    def to_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of the voice prompt on the model's device, copied without a sync."""
        device = self.device()
        if device.type != "cuda" or t.device.type != "cpu":
            return t.to(device, dtype)
        return t.to(dtype).pin_memory().to(device, non_blocking=True)

    def remember(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per key (LRU); the result is shared and never written to."""
        with self._memo_lock:
            hit = self._memo.get(key)
        if hit is not None:
            return hit
        value = make()
        with self._memo_lock:
            self._memo.put(key, value)
        return value

    def text(self, ids: list[int]) -> torch.Tensor:
        """Projected text embeddings T(ids) [1, n, H], from the kept rows (`text_rows`)."""
        if not ids:
            return self.text_rows(np.zeros(0, dtype=np.int64), self.ids([0])[0, :0])[None]
        return self.text_rows(np.asarray(ids, dtype=np.int64), self.ids(ids)[0])[None]

    def text_rows(self, host: np.ndarray, dev: torch.Tensor) -> torch.Tensor:
        """T(ids) [n, H] of ids given both on the host and on the device.

        T(.) is a per-token function (an embedding, then an MLP), so its rows are kept per token
        as they are first met: a prompt's rows then never depend on which other prompts share its
        batch (a GEMM's rows can differ in the last bit with its height), and a build gathers
        them with one call. New tokens are projected in groups of exactly `TEXT_GROUP` rows, so a
        token's row is the same whichever tokens came with it."""
        table = self._text_table
        if table is None:
            vocab = self.talker.model.text_embedding.num_embeddings
            probe = self.talker.embed_text(self.ids([0])[0])
            table = self._text_table = torch.empty(
                vocab, probe.shape[-1], dtype=probe.dtype, device=probe.device
            )
            self._text_known = np.zeros(vocab, dtype=bool)
        new = np.unique(host[~self._text_known[host]]) if len(host) else host
        for start in range(0, len(new), TEXT_GROUP):
            group = new[start : start + TEXT_GROUP]
            padded = np.zeros(TEXT_GROUP, dtype=np.int64)
            padded[: len(group)] = group
            rows = self.talker.embed_text(self.host_ids(padded))
            table[torch.from_numpy(group).to(table.device)] = rows[: len(group)]
            self._text_known[group] = True
        return torch.index_select(table, 0, dev)

    def codec(self, ids: list[int]) -> torch.Tensor:
        """Codec embeddings C(ids) [1, n, H]."""
        if len(ids) <= _MEMO_IDS:
            return self.remember(("codec", *ids), lambda: self.talker.embed_codec(self.ids(ids)))
        return self.talker.embed_codec(self.ids(ids))

    def codec_many(self, ids: list[int]) -> torch.Tensor:
        """C(ids) [n, H], not kept."""
        return self.talker.embed_codec(self.ids(ids)[0])

    def host_ids(self, ids: np.ndarray) -> torch.Tensor:
        """A host int64 array on the model's device, in one copy (pinned, without a sync)."""
        host = torch.from_numpy(ids)
        if self.device().type != "cuda":
            return host.to(self.device())
        return host.pin_memory().to(self.device(), non_blocking=True)

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        """Summed 16-codebook embeddings of frames: codes [T, 16] → [T, H]."""
        c0 = self.talker.embed_codec(codes[:, 0])
        rest = self.code_predictor.embed_codes(codes[:, 1:])
        return torch.cat([c0[:, None], rest], dim=1).sum(1)
