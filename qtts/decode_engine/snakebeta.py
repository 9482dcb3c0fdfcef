"""Fused SnakeBeta activation, y = x + inv_beta * sin(x * alpha)^2 per channel.

`alpha` and `inv_beta` are the per-channel factors precomputed once from the checkpoint's
log-scale parameters (`exp(alpha)` and `1 / (exp(beta) + 1e-9)`), so no step recomputes them.

The activation always feeds a causal conv whose input is `cat(history, activation)`, so the kernel
writes straight into the time range after the history inside a preallocated conv input: the
activation and the concatenation cost one pass over the tensor instead of three. On CUDA this is
one Triton kernel (math in float32, stored in the output dtype); elsewhere, or without Triton, the
same formula in torch.
"""

from __future__ import annotations

import torch

from qtts.decode_engine.snake_nwc import fast_sin_ok, sin_f32

try:  # Triton is only needed (and only present) on CUDA machines.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
    tl = None


def snake_factors(alpha_log: torch.Tensor, beta_log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (alpha, inv_beta) in float32 from the log-scale parameters of a SnakeBeta."""
    alpha = torch.exp(alpha_log.detach().float())
    inv_beta = 1.0 / (torch.exp(beta_log.detach().float()) + 1e-9)
    return alpha.contiguous(), inv_beta.contiguous()


def snake_reference(x: torch.Tensor, alpha_log: torch.Tensor, beta_log: torch.Tensor) -> torch.Tensor:
    """The checkpoint's formula, written from its definition (for tests)."""
    alpha = torch.exp(alpha_log)[None, :, None]
    beta = torch.exp(beta_log)[None, :, None]
    return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


def _snake_torch(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    y = xf + inv_beta[None, :, None] * torch.sin(xf * alpha[None, :, None]).pow(2)
    return y.to(x.dtype)


if triton is not None:

    @triton.jit
    def _snake_kernel(
        x_ptr,
        out_ptr,
        alpha_ptr,
        inv_beta_ptr,
        bias_ptr,
        channels,
        length,
        out_row_stride,
        out_offset,
        HAS_BIAS: tl.constexpr,
        FAST_SIN: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)  # b * channels + c
        blk = tl.program_id(1)
        c = row % channels
        a = tl.load(alpha_ptr + c)
        ib = tl.load(inv_beta_ptr + c)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = offs < length
        x = tl.load(x_ptr + row.to(tl.int64) * length + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + c).to(tl.float32)
        s = sin_f32(x * a, FAST_SIN)
        y = x + ib * s * s
        dst = out_ptr + row.to(tl.int64) * out_row_stride + out_offset + offs
        tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _bias_add_kernel(
        x_ptr,
        y_ptr,
        bias_ptr,
        out_ptr,
        channels,
        length,
        x_row_stride,
        HAS_Y: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        c = row % channels
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = offs < length
        x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + offs, mask=m, other=0.0)
        acc = x.to(tl.float32) + tl.load(bias_ptr + c).to(tl.float32)
        if HAS_Y:
            acc = acc + tl.load(y_ptr + row.to(tl.int64) * length + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * length + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


_BLOCK = 1024


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def snake(
    x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """SnakeBeta of (x + bias) for x [B, C, T] with precomputed per-channel factors; `bias` is the
    per-channel bias of the conv that produced x, added here instead of in a pass of its own."""
    if not _use_triton(x):
        return _snake_torch(x if bias is None else x + bias.to(x.dtype)[None, :, None], alpha, inv_beta)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x.contiguous(), out, alpha, inv_beta, bias, out.shape[-1], 0)
    return out


def snake_after_history(
    x: torch.Tensor,
    history: torch.Tensor,
    alpha: torch.Tensor,
    inv_beta: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cat([history, snake(x + bias)], dim=2)` for x [B, C, T] and history [B, C, h], one pass over x."""
    h = history.shape[-1]
    if not _use_triton(x):
        return torch.cat([history.to(x.dtype), snake(x, alpha, inv_beta, bias)], dim=2)
    b, c, t = x.shape
    out = torch.empty(b, c, h + t, device=x.device, dtype=x.dtype)
    out[:, :, :h] = history
    _launch(x.contiguous(), out, alpha, inv_beta, bias, h + t, h)
    return out


def bias_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous `x + bias[c] (+ residual)` for x [B, C, T] (x may be a time slice of a larger
    tensor, as a transposed conv's trimmed output is): the conv's bias, the copy that makes the slice
    contiguous and the residual add in one pass."""
    b, c, t = x.shape
    # Triton gets the view's own data pointer; rows (b, c) must be evenly strided.
    if not (_use_triton(x) and x.stride(2) == 1 and x.stride(0) == c * x.stride(1)):
        out = x + bias.to(x.dtype)[None, :, None]
        return out if residual is None else out + residual
    out = torch.empty(b, c, t, device=x.device, dtype=x.dtype)
    if b * c == 0 or t == 0:
        return out
    y = residual.contiguous() if residual is not None else out
    grid = (b * c, triton.cdiv(t, _BLOCK))
    _bias_add_kernel[grid](
        x, y, bias, out, c, t, x.stride(1), HAS_Y=residual is not None, BLOCK=_BLOCK, num_warps=4
    )
    return out


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    alpha: torch.Tensor,
    inv_beta: torch.Tensor,
    bias: torch.Tensor | None,
    row_stride: int,
    offset: int,
) -> None:
    b, c, t = x.shape
    if b * c == 0 or t == 0:
        return
    grid = (b * c, triton.cdiv(t, _BLOCK))
    _snake_kernel[grid](
        x,
        out,
        alpha,
        inv_beta,
        alpha if bias is None else bias,
        c,
        t,
        row_stride,
        offset,
        HAS_BIAS=bias is not None,
        FAST_SIN=fast_sin_ok(x),
        BLOCK=_BLOCK,
        num_warps=4,
    )
