"""The FP8 format and the quantized-activation record shared by `fp8` (the linears) and
`triton_fp8` (the kernels that quantize): a module of its own so that neither imports the other
to get them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class QuantRows:
    """An activation [M, K] already quantized per row (by a fused kernel): float8 `q`, scale [M, 1],
    and `dtype`, the model dtype it was computed in (the product's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
