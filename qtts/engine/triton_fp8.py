"""Per-token FP8 quantization of activations as one Triton kernel (`fp8.quantize_rows` on CUDA).

One program per row: load the row, absolute maximum, scale = amax / 448, store the row divided by
its scale as float8_e4m3fn (clamped to +-448) and the float32 scale. Four PyTorch kernels
(abs-amax, divide, clamp, cast) become one, which matters in the frame step: every FP8 linear
quantizes its input, about 400 times a frame.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU builds run the PyTorch path instead.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, sx, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < K
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (float8_e4m3fn [M, K], float32 scale [M, 1])."""
    from qtts.engine.fp8 import FP8, FP8_MAX

    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows needs rows with contiguous columns")
    q = torch.empty(m, k, device=x.device, dtype=FP8)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](
        x, q, scale, k, x.stride(0), FP8_MAX=FP8_MAX, BLOCK=block, num_warps=8 if block >= 4096 else 4
    )
    return q, scale
