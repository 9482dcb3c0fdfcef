"""SnakeBeta for time-major activations [B, T, C], fused with what surrounds it in the decoder.

In the channels-last conv stack every SnakeBeta sits between a producer whose bias (and, after a
residual unit, whose residual add) is still pending and a conv that reads `cat(history, act)`.
One pass does all of it:

    v = x + bias[c] + residual          (the pending bias and residual add)
    sum_out = v                         (optional: the residual stream the next unit adds to)
    act = v + inv_beta[c] * sin(alpha[c] * v)^2, written after the history in the conv's input

and for a transposed conv whose two taps are one GEMM, the "paired" layout [B, T, 2C] holds the
previous step's activation in the first C columns and the step's own in the last C columns.

On CUDA (or under TRITON_INTERPRET=1 when asked) this is one Triton kernel, math in float32; the
torch version computes the same in float32 and is what CPU runs use by default.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is only needed (and only present) on CUDA machines.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None
    sin_f32 = None


def triton_available(x: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on x (a CUDA tensor, or any under the interpreter)."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def fast_sin_ok(x: torch.Tensor) -> bool:
    """The hardware sine (`sin.approx.f32`, absolute error ~2^-20.5 up to |x| = 100 pi) for 16-bit
    activations on CUDA: far below their rounding, and ~5x fewer instructions than the precise
    sine, which made the SnakeBeta passes compute-bound. Float32 keeps the precise one."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def sin_f32(x, FAST: tl.constexpr):
        if FAST:
            return tl.inline_asm_elementwise(
                "sin.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return tl.sin(x)

    @triton.jit
    def _snake_nwc_kernel(
        x_ptr,
        res_ptr,
        bias_ptr,
        alpha_ptr,
        inv_beta_ptr,
        sum_ptr,
        out_ptr,
        rows,
        channels,
        steps,
        out_batch_stride,
        out_row_stride,
        out_row_offset,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
        WRITE_SUM: tl.constexpr,
        PAIRED: tl.constexpr,
        FAST_SIN: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # A tile of (b, t) rows x channels: the row arithmetic is per row and in 32 bits, the
        # addresses in 64 (a step may hold more than 2^31 elements).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        r_ok = r < rows
        c_ok = c < channels
        m = r_ok[:, None] & c_ok[None, :]
        src = (r.to(tl.int64) * channels)[:, None] + c[None, :]
        v = tl.load(x_ptr + src, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = v + tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            v = v + tl.load(res_ptr + src, mask=m, other=0.0).to(tl.float32)
        if WRITE_SUM:
            tl.store(sum_ptr + src, v.to(sum_ptr.dtype.element_ty), mask=m)
        a = tl.load(alpha_ptr + c, mask=c_ok, other=0.0)[None, :]
        ib = tl.load(inv_beta_ptr + c, mask=c_ok, other=0.0)[None, :]
        s = sin_f32(v * a, FAST_SIN)
        y = (v + ib * s * s).to(out_ptr.dtype.element_ty)
        b = r // steps
        t = r % steps
        base = b.to(tl.int64) * out_batch_stride
        if PAIRED:
            # Own step in the second half of row t, previous step of row t + 1 in the first half.
            own = base + t.to(tl.int64) * out_row_stride + channels
            tl.store(out_ptr + own[:, None] + c[None, :], y, mask=m)
            nxt = base + (t + 1).to(tl.int64) * out_row_stride
            tl.store(out_ptr + nxt[:, None] + c[None, :], y, mask=m & (t + 1 < steps)[:, None])
        else:
            dst = base + (t + out_row_offset).to(tl.int64) * out_row_stride
            tl.store(out_ptr + dst[:, None] + c[None, :], y, mask=m)


_TILE = 4096  # elements per program


def _torch_value(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    v = x.float()
    if bias is not None:
        v = v + bias.float()
    if residual is not None:
        v = v + residual.float()
    return v


def _torch_snake(v: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    return v + inv_beta * torch.sin(v * alpha).pow(2)


def snake_nwc(
    x: torch.Tensor,
    history: torch.Tensor,
    alpha: torch.Tensor,
    inv_beta: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    want_sum: bool = False,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`cat([history, snake(x + bias + residual)], dim=1)` for x [B, T, C], history [B, h, C]
    (h may be 0), and with `want_sum` also `x + bias + residual` itself (else None)."""
    b, t, c = x.shape
    h = history.shape[1]
    if use_triton is None:
        use_triton = x.is_cuda and triton is not None
    if not use_triton:
        v = _torch_value(x, bias, residual)
        act = _torch_snake(v, alpha, inv_beta).to(x.dtype)
        full = torch.cat([history.to(x.dtype), act], dim=1) if h else act
        return full, (v.to(x.dtype) if want_sum else None)
    out = torch.empty(b, h + t, c, device=x.device, dtype=x.dtype)
    if h:
        out[:, :h] = history
    total = _launch(x, out, alpha, inv_beta, bias, residual, want_sum, paired=False, offset=h)
    return out, total


def snake_nwc_paired(
    x: torch.Tensor,
    history: torch.Tensor,
    alpha: torch.Tensor,
    inv_beta: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """[B, T, 2C]: row t holds (act[t-1], act[t]) with act = snake(x + bias + residual) for x
    [B, T, C] and act[-1] = history [B, 1, C]: the input of a 2-tap transposed conv as one GEMM."""
    b, t, c = x.shape
    if use_triton is None:
        use_triton = x.is_cuda and triton is not None
    if not use_triton:
        act = _torch_snake(_torch_value(x, bias, residual), alpha, inv_beta).to(x.dtype)
        prev = torch.cat([history.to(x.dtype), act[:, :-1]], dim=1)
        return torch.cat([prev, act], dim=2)
    out = torch.empty(b, t, 2 * c, device=x.device, dtype=x.dtype)
    out[:, 0, :c] = history[:, 0]
    _launch(x, out, alpha, inv_beta, bias, residual, False, paired=True, offset=0)
    return out


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    alpha: torch.Tensor,
    inv_beta: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    want_sum: bool,
    *,
    paired: bool,
    offset: int,
) -> torch.Tensor | None:
    b, t, c = x.shape
    x = x.contiguous()
    res = residual.contiguous() if residual is not None else x
    total = torch.empty_like(x) if want_sum else None
    if b * t * c == 0:
        return total
    block_c = min(triton.next_power_of_2(c), 128)
    block_r = _TILE // block_c
    grid = (triton.cdiv(b * t, block_r), triton.cdiv(c, block_c))
    _snake_nwc_kernel[grid](
        x,
        res,
        alpha if bias is None else bias,
        alpha,
        inv_beta,
        x if total is None else total,
        out,
        b * t,
        c,
        t,
        out.stride(0),
        out.stride(1),
        offset,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        WRITE_SUM=want_sum,
        PAIRED=paired,
        FAST_SIN=fast_sin_ok(x),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=8,
    )
    return total
