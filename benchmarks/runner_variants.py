"""Runner variants measured against serving and dropped from it, kept so the benchmarks can rerun them.

`benchmarks.talker_step --variants ATTENTION/MODE` builds its runner here:

- attention `sdpa_grouped` (the PyTorch decode only): for one query position with GQA, the query
  heads of a KV group become query positions, so SDPA runs without expanding K/V to every head;
- mode `compile-nocarry`: the fast-path predictor writes its per-frame K/V into `pk_cache` instead
  of carrying them as tensors through one compiled function per layer.

BENCHMARKS.md records what they measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtts.engine.fused_layers import attend
from qtts.engine.model_runner import ModelRunner, RunnerConfig

GROUPED_SDPA = "sdpa_grouped"
NO_CARRY = "compile-nocarry"


def attend_sdpa_grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """`attend(..., "sdpa")`, but one query position over grouped K/V runs as a group's heads as positions."""
    hq, hkv = q.shape[1], k.shape[1]
    if q.shape[2] == 1 and hq != hkv:
        scale = q.shape[-1] ** -0.5
        b, _, _, d = q.shape
        qg = q.reshape(b, hkv, hq // hkv, d)  # a group's query heads as query positions
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return out.reshape(b, hq, 1, d)
    return attend(q, k, v, mask, "sdpa")


class VariantRunner(ModelRunner):
    """`ModelRunner` with the measured-out variants switchable."""

    def __init__(
        self, bundle, config: RunnerConfig, *, grouped_sdpa: bool = False, predictor_carry_kv: bool = True
    ) -> None:
        self.grouped_sdpa = grouped_sdpa
        self.predictor_carry_kv = predictor_carry_kv
        super().__init__(bundle, config)

    def _talker_attention(self, q, keys, values, mask) -> torch.Tensor:
        if self.grouped_sdpa:
            return attend_sdpa_grouped(q, keys, values, mask)
        return super()._talker_attention(q, keys, values, mask)


def serving_attention(attention: str) -> str:
    """The `RunnerConfig.talker_attention` a benchmark attention variant runs under."""
    return "sdpa" if attention == GROUPED_SDPA else attention


def variant_runner(bundle, config: RunnerConfig, attention: str, mode: str) -> VariantRunner:
    """The runner of one `talker_step` variant; `config` carries `serving_attention(attention)`."""
    return VariantRunner(
        bundle, config, grouped_sdpa=attention == GROUPED_SDPA, predictor_carry_kv=mode != NO_CARRY
    )
