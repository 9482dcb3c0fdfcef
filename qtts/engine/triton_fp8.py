"""Per-token FP8 quantization of activations in Triton (`fp8.quantize_rows` on CUDA), alone or
fused into the kernel that produces the activation.

One program per row: the row, its absolute maximum, scale = amax / 448, the row divided by its
scale stored as float8_e4m3fn (clamped to +-448) with the float32 scale. Four PyTorch kernels
(abs-amax, divide, clamp, cast) become one, which matters in the frame step: every FP8 linear
quantizes its input, about 400 times a frame. `add_rms_norm_fp8` and `silu_mul_fp8` also fold the
quantization into the norm before q|k|v and gate|up and into the SwiGLU before down, so only the
o projection's input takes the separate kernel. Each rounds its output to the model dtype first,
as the unfused kernels store it, so the FP8 values equal those of norm/SwiGLU + `quantize_rows`.
"""

from __future__ import annotations

import torch

from qtts.engine.fp8_types import FP8, FP8_MAX, QuantRows

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


if triton is not None:

    @triton.jit
    def _quantize_store(q_ptr, s_ptr, row, offs, m, v, K, FP8_MAX: tl.constexpr):
        """Row `row` of v (float32, [BLOCK], masked to K) as float8 with its scale."""
        scale = tl.maximum(tl.max(tl.abs(tl.where(m, v, 0.0)), axis=0), 1e-12) / FP8_MAX
        q = tl.minimum(tl.maximum(v / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _add_rms_norm_fp8_kernel(
        x_ptr,
        d_ptr,
        w_ptr,
        xo_ptr,
        q_ptr,
        s_ptr,
        eps,
        H: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_D: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < H
        x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0)
        if HAS_D:
            d = tl.load(d_ptr + row * H + offs, mask=m, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(xo_ptr.dtype.element_ty)
            tl.store(xo_ptr + row * H + offs, x, mask=m)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        h = (xf * inv * w).to(xo_ptr.dtype.element_ty).to(tl.float32)
        _quantize_store(q_ptr, s_ptr, row, offs, m, h, H, FP8_MAX)

    @triton.jit
    def _silu_mul_fp8_kernel(
        gu_ptr, q_ptr, s_ptr, inter, DT: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr
    ):
        row = tl.program_id(0)
        col = tl.arange(0, BLOCK)
        m = col < inter
        g = tl.load(gu_ptr + row * 2 * inter + col, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + col, mask=m, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
        _quantize_store(q_ptr, s_ptr, row, col, m, (silu * u).to(DT).to(tl.float32), inter, FP8_MAX)


def _tl_dtype(dtype: torch.dtype):
    return {
        torch.bfloat16: tl.bfloat16,
        torch.float16: tl.float16,
        torch.float32: tl.float32,
        torch.float64: tl.float64,
    }[dtype]


def add_rms_norm_fp8(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`triton_ops.add_rms_norm` whose normed output comes quantized: (x + delta, QuantRows)."""
    m, h = x.shape
    x_out = torch.empty_like(x) if delta is not None else x
    q = torch.empty(m, h, device=x.device, dtype=FP8)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(h)
    _add_rms_norm_fp8_kernel[(m,)](
        x,
        delta if delta is not None else x,
        weight,
        x_out,
        q,
        scale,
        eps,
        H=h,
        BLOCK=block,
        HAS_D=delta is not None,
        FP8_MAX=FP8_MAX,
        num_warps=8 if block >= 4096 else 4,
    )
    return x_out, QuantRows(q, scale, x.dtype)


def silu_mul_fp8(gate_up: torch.Tensor):
    """`triton_ops.silu_mul`, quantized per row: [M, 2I] -> QuantRows of silu(gate) * up."""
    m, two_i = gate_up.shape
    inter = two_i // 2
    q = torch.empty(m, inter, device=gate_up.device, dtype=FP8)
    scale = torch.empty(m, 1, device=gate_up.device, dtype=torch.float32)
    block = triton.next_power_of_2(inter)
    _silu_mul_fp8_kernel[(m,)](
        gate_up,
        q,
        scale,
        inter,
        DT=_tl_dtype(gate_up.dtype),
        BLOCK=block,
        FP8_MAX=FP8_MAX,
        num_warps=8 if block >= 4096 else 4,
    )
    return QuantRows(q, scale, gate_up.dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (float8_e4m3fn [M, K], float32 scale [M, 1])."""
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
