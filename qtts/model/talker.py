"""The talker LM: Qwen3 decoder over summed text+codec embeddings, codec head for codebook 0.

Checkpoint names (prefix `talker.`): `model.layers.*`, `model.norm`, `model.codec_embedding`,
`model.text_embedding`, `text_projection.linear_fc{1,2}`, `codec_head`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qtts.model.config import TalkerModelConfig
from qtts.model.layers import DecoderStack, KVCache


class TalkerBackbone(DecoderStack):
    """Decoder stack plus the two input embedding tables (names as in `talker.model.*`)."""

    def __init__(self, cfg: TalkerModelConfig):
        super().__init__(cfg.decoder)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.decoder.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    """Linear(text_hidden→text_hidden) + SiLU + Linear(text_hidden→H), with biases."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """Talker LM (weights under `talker.*` except `talker.code_predictor.*`)."""

    def __init__(self, cfg: TalkerModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = TalkerBackbone(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.decoder.hidden_size)
        self.codec_head = nn.Linear(cfg.decoder.hidden_size, cfg.vocab_size, bias=False)

    @property
    def hidden_size(self) -> int:
        return self.cfg.decoder.hidden_size

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Projected text embeddings T(ids): [..., H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec (codebook-0 / control id) embeddings C(ids): [..., H]."""
        return self.model.codec_embedding(ids)

    def allocate_cache(self, slots: int, capacity: int, device, dtype) -> KVCache:
        return KVCache.allocate(self.cfg.decoder, slots, capacity, device, dtype)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache,
        span: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [B, T, H] → (final-normed hidden [B, T, H], codebook-0 logits [B, T, vocab])."""
        hidden = self.model(embeds, positions, slots, cache, span)
        return hidden, self.codec_head(hidden)
