"""The per-frame code predictor (codebooks 1..15).

For each frame it runs a fresh sequence `[h_t, C(c0_t)]` (h_t: the talker's final-normed hidden
state that produced codebook 0; C: the talker's codec embedding), then 14 more single-token steps;
head j gives code j+1 and the predictor's own embedding table j turns it into the next input. All
inputs live in the talker's width and go through `small_to_mtp_projection` (identity when the widths
match). Checkpoint names (prefix `talker.code_predictor.`): `model.layers.*`, `model.norm`,
`model.codec_embedding.N`, `lm_head.N`, `small_to_mtp_projection`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qtts.model.config import PredictorConfig
from qtts.model.layers import DecoderStack, KVCache


class PredictorBackbone(DecoderStack):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int):
        super().__init__(cfg.decoder)
        self.codec_embedding = nn.ModuleList(
            [nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1)]
        )


class CodePredictor(nn.Module):
    def __init__(self, cfg: PredictorConfig, talker_hidden: int):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.decoder.hidden_size
        self.model = PredictorBackbone(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(
            [nn.Linear(hidden, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)]
        )
        if hidden != talker_hidden:
            self.small_to_mtp_projection: nn.Module = nn.Linear(talker_hidden, hidden, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()

    @property
    def num_steps(self) -> int:
        return self.cfg.num_code_groups - 1

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Embeddings (talker width) of codebooks 1..15: codes [..., 15] → [..., 15, H]."""
        return torch.stack([self.model.codec_embedding[j](codes[..., j]) for j in range(self.num_steps)], -2)

    def forward(
        self,
        talker_hidden: torch.Tensor,
        c0_embed: torch.Tensor,
        choose: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Predict codebooks 1..15 for a batch of frames.

        talker_hidden, c0_embed: [B, H_talker]. `choose(j, logits[B, vocab]) -> LongTensor[B]`
        picks code j+1 (sampling is the caller's). Returns LongTensor [B, 15].
        """
        b = talker_hidden.shape[0]
        device, dtype = talker_hidden.device, talker_hidden.dtype
        cache = KVCache.allocate(self.cfg.decoder, b, self.cfg.num_code_groups + 1, device, dtype)
        slots = torch.arange(b, device=device)
        x = self.small_to_mtp_projection(torch.stack([talker_hidden, c0_embed], dim=1))
        positions = torch.arange(2, device=device).expand(b, 2)
        codes = []
        for j in range(self.num_steps):
            hidden = self.model(x, positions, slots, cache, span=j + 2)
            code = choose(j, self.lm_head[j](hidden[:, -1]))
            codes.append(code)
            if j + 1 < self.num_steps:
                x = self.small_to_mtp_projection(self.model.codec_embedding[j](code))[:, None]
                positions = positions[:, -1:] + 1
        return torch.stack(codes, dim=1)
