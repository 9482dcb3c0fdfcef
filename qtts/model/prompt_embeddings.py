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

import torch

from qtts.lru import BoundedLru

_MEMO_IDS = 8  # id lists up to this long have their embeddings kept (special tokens, roles)


class PromptEmbeddings:
    """T(.), C(.) and frame embeddings of a loaded talker and code predictor, kept where reusable."""

    def __init__(self, talker, code_predictor):
        self.talker = talker
        self.code_predictor = code_predictor
        self._memo: BoundedLru[tuple, object] = BoundedLru(512)
        self._memo_lock = threading.Lock()

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
        """Projected text embeddings T(ids) [1, n, H]."""
        if len(ids) <= _MEMO_IDS:
            return self.remember(("text", *ids), lambda: self.talker.embed_text(self.ids(ids)))
        return self.talker.embed_text(self.ids(ids))

    def codec(self, ids: list[int]) -> torch.Tensor:
        """Codec embeddings C(ids) [1, n, H]."""
        if len(ids) <= _MEMO_IDS:
            return self.remember(("codec", *ids), lambda: self.talker.embed_codec(self.ids(ids)))
        return self.talker.embed_codec(self.ids(ids))

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        """Summed 16-codebook embeddings of frames: codes [T, 16] → [T, H]."""
        c0 = self.talker.embed_codec(codes[:, 0])
        rest = self.code_predictor.embed_codes(codes[:, 1:])
        return torch.cat([c0[:, None], rest], dim=1).sum(1)
